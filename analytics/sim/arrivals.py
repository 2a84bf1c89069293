"""Requests reaching a simulated cluster (:class:`~analytics.sim.cluster.SimCluster`): arrival
and admission, the router turning a request away, the client's retries and final refusals, the
admission queue's pump, and an engine failing a request."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, cast

from admission.core import Rejection
from analytics.sim.admission import Refused
from analytics.sim.traces import TraceRequest

if TYPE_CHECKING:
    from analytics.sim.cluster import SimCluster

__all__ = ["ended", "on_arrive", "on_fail", "pump", "refuse", "retry", "turned_away"]


def turned_away(sim: SimCluster, idx: int, rej: Rejection, now: float) -> None:
    """The router refuses request ``idx`` (no candidates, no fit, its deadline): an
    admitted one gives its reservation back; the client retries as the retry model says."""
    r = sim.requests[idx]
    if sim.adm is not None:  # (only admitted requests are routed)
        got = sim.adm.refuse_admitted(idx, f"r{idx}", r.priority, rej, now)
    else:
        got = Refused(idx, r.priority, rej.reason, rej.retry_after_s, now)
    retry(sim, r, idx, sim.attempts.get(idx, 1), got, now)


def refuse(sim: SimCluster, got: Refused) -> None:
    sim.refused.append(got)
    sim.remaining -= 1
    ended(sim, got.index, got.at_s)


def ended(sim: SimCluster, idx: int, now: float) -> None:
    """Request ``idx`` is over (answered, failed, finally refused): in closed loop, its
    session's next turn is sent its think time later."""
    nxt = sim.follower.pop(idx, None)
    if nxt is not None:
        r = sim.requests[nxt]
        at = now + (r.think_s or 0.0)
        sim.requests[nxt] = replace(r, arrival_s=at)
        sim.push(at, "arrive", nxt)


def retry(
    sim: SimCluster, r: TraceRequest, idx: int, attempt: int, got: Refused, now: float
) -> None:
    """A refused client comes back (or gives up): the retry model decides when."""
    rm = sim.cfg.retries
    storm = rm is not None and r.client in rm.storm_clients
    limit = 1 if rm is None else (rm.storm_max_attempts if storm else rm.max_attempts)
    if rm is None or attempt >= limit or not got.retry_after_s:
        refuse(sim, replace(got, attempt=attempt))
        return
    sim.refused.append(replace(got, attempt=attempt, final=False))
    delay = rm.storm_delay_s if storm else got.retry_after_s
    sim.push(now + delay, "retry", (idx, attempt + 1))


def pump(sim: SimCluster, now: float) -> None:
    if sim.adm is None:
        return
    admitted, gone = sim.adm.pump(now)
    for g in gone:
        refuse(sim, g)
    for idx, wait in admitted:
        sim.dispatch(idx, now, wait)


def on_arrive(sim: SimCluster, now: float, data: object, kind: str = "arrive") -> None:
    """A request arrives (``retry``: a refused client comes back; ``scaled``: it waited for its
    model's first ready node): the waiting room of a model scaling up, admission, routing."""
    idx, attempt = (data, 1) if kind == "arrive" else cast(tuple[int, int], data)
    assert isinstance(idx, int)
    sim.attempts[idx] = attempt
    if kind == "arrive":
        sim.seen["arrivals"] += 1
        if sim.sessions is not None:  # the gap since its session's last turn
            sim.sessions.began(sim.requests[idx].session_id, now)
    if kind != "scaled" and sim.scale_room.holds(idx, attempt, now):
        return
    if sim.adm is None:
        sim.dispatch(idx, now, None)
    else:
        r = sim.requests[idx]
        key = f"a{idx}"  # the attempt's identity (an Idempotency-Key)
        got: bool | Refused | None = sim.adm.early_retry(r.client, key, idx, r.priority, now)
        if got is None:
            got = sim.adm.arrive(
                idx,
                f"r{idx}",
                r.priority,
                r.prompt_tokens,
                r.output_tokens,
                now,
                sim.slo_classes[r.slo_class].ttft_s if r.slo_class else None,
                r.client or "",
            )
            if isinstance(got, Refused):
                sim.adm.remember(key, got, now, r.client)
        if got is True:
            sim.dispatch(idx, now, None)
        elif isinstance(got, Refused):
            retry(sim, r, idx, attempt, got, now)
        else:  # queued: the pump runs at once (as the live gate's), room a preemption made
            pump(sim, now)


def on_fail(sim: SimCluster, now: float, data: object) -> None:
    """A broken engine's 500: the client sees it, the router counts it."""
    rid, node_id = cast(tuple[str, str], data)
    sim.ledger.finish(rid)
    if sim.fleet.detector.observe(node_id, "5xx", now, len(sim.present)) is not None:
        sim.stats["ejections"] = sim.stats.get("ejections", 0) + 1
    sim.stats["failed"] += 1
    sim.remaining -= 1
    ended(sim, int(rid[1:]), now)
    if sim.adm is not None:
        sim.adm.release(rid, now)
        pump(sim, now)
