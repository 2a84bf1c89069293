"""A request the routing pipeline holds in the router (router/decision/pipeline.py: ``Held``):
polled while it waits for its SLO class or for room for its KV, then in the router's queue under
the lane rules, until it is routed or refused. The director's request path calls
:func:`until_routed` between the first decision and the request's dispatch."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from router.decision.pipeline import Decision, Held, Refused, Routed, Snapshot, decide
from router.flow.asks import Gated
from router.flow.waiting import Held as QueueHeld
from router.flow.waiting import Waiting
from router.parse import ParsedRequest

if TYPE_CHECKING:
    from router.decision.pipeline import Ask
    from router.flow.director import Director

__all__ = ["until_routed"]


async def until_routed(
    d: Director, ask: Ask, g: Gated, got: Decision, snap: Snapshot, p: ParsedRequest
) -> tuple[Routed | Refused, Snapshot, bool]:
    """``got``, once the request has waited as long as the pipeline holds it: for its SLO
    class or for room for its KV (polled), then in the router's queue (the lane rules).
    Returns the decision it leaves with, the snapshot it was made on, and whether it is
    committed already (the router's queue commits a request the moment its turn routes
    it)."""
    if isinstance(got, Held) and got.why in ("slo", "fit"):
        d.metrics.held.inc()
        d.metrics.holds.inc()
        try:
            while isinstance(got, Held) and got.why in ("slo", "fit"):
                await asyncio.sleep(d.settings.hold_poll_s)
                snap = d.again(ask, g)
                got = decide(ask, snap, d.rules)
        finally:
            d.metrics.held.dec()
    if not isinstance(got, Held):
        return got, snap, False
    if d.queue.full:
        return got.now, snap, False
    return await _queued(d, ask, g, got, p)


async def _queued(
    d: Director, ask: Ask, g: Gated, got: Held, p: ParsedRequest
) -> tuple[Routed | Refused, Snapshot, bool]:
    """The lane rules' queue (router/decision/lanes.py): the request waits in the router's
    queue, short requests first, decided again when its turn comes — and committed at once
    when it is routed, so that the next request of the round sees it on its node — at most
    ``lanes.hold_max_s`` (or half its lease) since it arrived; then the pipeline sends it to
    its best node whatever the lane rules say."""
    lanes = d.rules.lanes
    assert lanes is not None  # the live router always has its lane rules
    facts = got.now.facts if isinstance(got.now, Routed) else None
    long = facts.long if facts is not None else False

    def turn() -> tuple[Routed | Refused, Snapshot] | QueueHeld:
        again = d.again(ask, g)
        now = decide(ask, again, d.rules)
        if isinstance(now, Held):
            return QueueHeld(now.blocker)
        if isinstance(now, Routed):
            d.commit(ask, again, now, p)
        return now, again

    limit = min(lanes.s.hold_max_s, d.gate.settings.lease_s / 2)
    limit -= time.time() - ask.arrived_s
    d.metrics.lane_held.inc()
    d.metrics.lane_holds.labels("long" if long else "short").inc()
    try:
        routed = await d.queue.wait(
            lanes.key(ask.arrived_s, long), long, Waiting(turn), max(0.0, limit), got.blocker
        )
    finally:
        d.metrics.lane_held.dec()
    if routed is not None:
        return routed[0], routed[1], isinstance(routed[0], Routed)
    # waited long enough: its best node, whatever the lane rules
    again = d.again(ask, g)
    last = decide(ask, again, d.rules)
    return (last.now if isinstance(last, Held) else last), again, False
