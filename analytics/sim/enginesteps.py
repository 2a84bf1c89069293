"""The simulated engines' steps in virtual time, for a :class:`~analytics.sim.cluster.SimCluster`:
a node starts a step or a decode run (several steps at once, cut short when a request arrives),
its KV events go to the index late, and the events that end steps and runs, or that load a hot
prefix, are handled here (a prompt's KV crossing between engines: analytics/sim/legs.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from agents.scheduler import DecodeRun
from analytics.sim.simcore import SimSeq, SimStep
from analytics.sim.simnode import SimNode
from router.decision.hotprefix import PrewarmAdvice

if TYPE_CHECKING:
    from analytics.sim.cluster import SimCluster

__all__ = [
    "catch_up",
    "cut_run",
    "drain",
    "on_run_ended",
    "on_step",
    "on_warm",
    "start_step",
]


def drain(sim: SimCluster, n: SimNode, now: float) -> None:
    evs = n.core.drain_events()
    if evs:
        sim.lagged.append((now + sim.cfg.index_lag_s, n.node_id, evs))


def start_step(sim: SimCluster, n: SimNode, now: float) -> None:
    n.busy = True
    run = n.core.plan_decode_run() if sim.cfg.fast_forward else None
    if run is not None:
        n.run, n.run_start, n.run_applied = run, now, 0
        sim.push(now + run.elapsed(run.steps), "run", (n.node_id, n.gen))
        return
    res = n.core.step(now)
    drain(sim, n, now)
    sim.push(now + res.duration_s, "step", (n.node_id, res))


def catch_up(sim: SimCluster, n: SimNode, now: float) -> None:
    """Apply ``n``'s decode run up to and including the step in progress at ``now`` — an
    engine applies a step when it starts it, and delivers its tokens when it ends."""
    run = n.run
    if run is None:
        return
    upto = min(run.steps, run.steps_done(now - n.run_start) + 1)
    if upto > n.run_applied:
        n.finishing += n.core.advance_decode(upto - n.run_applied, now)
        n.run_applied = upto
        drain(sim, n, now)


def cut_run(sim: SimCluster, n: SimNode, now: float) -> None:
    """A request arrives: the run stops after the step in progress."""
    run = n.run
    if run is None:
        return
    catch_up(sim, n, now)
    if n.run_applied < run.steps:
        n.run = DecodeRun(n.run_applied, run.first_s, run.grow_s)
        n.gen += 1
        sim.push(n.run_start + run.elapsed(n.run_applied), "run", (n.node_id, n.gen))


def on_warm(sim: SimCluster, now: float, data: object) -> None:
    """An agent loads a hot prefix into its engine."""
    advice, hashes = cast(tuple[PrewarmAdvice, tuple[int, ...]], data)
    for node_id in advice.targets:
        sim.stats["prewarm_requests"] += 1
        warm = SimSeq(
            f"warm{sim.stats['prewarm_requests']}",
            advice.blocks * sim.trace.block_size,
            1,
            list(hashes[: advice.blocks]),
        )
        sim.add(sim.by_id[node_id], warm, now)


def on_run_ended(sim: SimCluster, now: float, data: object) -> None:
    """A decode run ends."""
    node_id, gen = cast(tuple[str, int], data)
    n = sim.by_id[node_id]
    if gen != n.gen or n.run is None:
        return  # replaced by a shorter run
    catch_up(sim, n, now)
    n.run, finished, n.finishing = None, n.finishing, []
    sim.step_done(n, now, finished)


def on_step(sim: SimCluster, now: float, data: object) -> None:
    """A step finished."""
    node_id, res = cast(tuple[str, SimStep], data)
    n = sim.by_id[node_id]
    for seq in res.first:
        sim.ledger.first_token(seq.request_id, now)
        if sim.recent is not None and seq.request_id in sim.meta:
            # the prompt's blocks are in the node's cache from now on
            sim.recent.add(node_id, sim.meta[seq.request_id][0].block_hashes, now)
    sim.step_done(n, now, res.finished)
