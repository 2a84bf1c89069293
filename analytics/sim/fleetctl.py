"""The simulated fleet over time: operations on it (:func:`operate`: drain, join, leave,
canary, heal) and the closed-loop autoscaler's decisions (:func:`control`), applied to a
:class:`~analytics.sim.cluster.SimCluster`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from analytics.autoscale import Observation
from analytics.sim.simconfig import FleetOp, ScalePoint
from analytics.sim.simcore import SimCore

if TYPE_CHECKING:
    from analytics.sim.cluster import SimCluster

__all__ = ["control", "operate"]


def operate(sim: SimCluster, op: FleetOp, now: float) -> None:
    """Apply a fleet operation (drain, undrain, join, leave, canary, heal); admission's
    budget follows the nodes that take requests."""
    if op.kind == "drain":
        sim.fleet.drained.add(op.node)
    elif op.kind == "undrain":
        sim.fleet.drained.discard(op.node)
    elif op.kind == "join":
        if op.node in sim.loading:  # the autoscaler's node: loaded, it serves from now
            sim.loading.discard(op.node)
        sim.present.add(op.node)
        sim.started[op.node] = now  # its view appears with the next heartbeat
    elif op.kind == "leave":
        sim.present.discard(op.node)
        sim.by_id[op.node].view = None
    elif op.kind == "canary":
        sim.fleet.set_canary("canary", op.nodes, op.share)
    elif op.kind == "heal":
        sim.faults.pop(op.node, None)
    if sim.adm is not None:  # the budget follows the nodes that take requests
        serving = len(sim.present - sim.fleet.drained)
        sim.adm.kv_blocks_total = sim.profile.num_gpu_blocks * serving
        sim.adm.slots_total = sim.adm.settings.slots_per_node * serving


def control(sim: SimCluster, now: float) -> None:
    """One autoscaler decision: observe the pool, add cold nodes (serving after the lead
    time) or remove the least busy ones (they drain)."""
    assert sim.scaler is not None
    s = sim.scaler.settings
    for name in list(sim.leaving):  # drained: no longer paid for
        if sim.by_id[name].core.idle and not sim.by_id[name].busy:
            sim.leaving.discard(name)
    serving = sorted(sim.present - sim.fleet.drained)
    cores = [sim.by_id[name].core for name in serving]
    obs = Observation(
        now=now,
        replicas=len(serving),
        arrivals=int(sim.seen["arrivals"]),
        waiting=sum(len(c.waiting) for c in cores) + len(sim.holding) + len(sim.lane_queue),
        running=sum(len(c.running) for c in cores),
        kv_used=(
            sum(c.cache.used_blocks / c.cache.num_blocks for c in cores) / len(cores)
            if cores
            else 1.0
        ),
        refusals=len(sim.refused) - int(sim.seen["refused"]),
    )
    desired = sim.scaler.observe(obs)
    have = len(sim.present) + len(sim.loading)
    if desired > have:
        idle = [
            n
            for n in sim.nodes
            if n.node_id not in sim.present
            and n.node_id not in sim.loading
            and n.node_id not in sim.leaving
            and n.core.idle
            and not n.busy
        ]
        for n in idle[: desired - have]:
            n.core = SimCore(sim.profile)  # a new replica: an empty cache
            n.run, n.gen, n.finishing = None, n.gen + 1, []
            sim.index.drop_node(n.node_id)
            sim.loading.add(n.node_id)
            sim.push(now + s.lead_time_s, "op", FleetOp(now + s.lead_time_s, "join", n.node_id))
    elif desired < have:
        for _ in range(have - desired):
            if sim.loading:  # not serving yet: cancel the newest load
                name = max(sim.loading)
                sim.loading.discard(name)
                sim.cancelled.add(name)
                continue
            if len(sim.present) <= max(1, s.min_replicas):
                break
            name = min(sim.present, key=lambda x: len(sim.by_id[x].core.running))
            operate(sim, FleetOp(now, "leave", name), now)
            sim.leaving.add(name)
    paid = len(sim.present) + len(sim.loading) + len(sim.leaving)
    sim.stats["gpu_seconds"] += round(sim.seen["paid"] * (now - sim.seen["at"]))
    sim.seen.update(arrivals=0, refused=len(sim.refused), paid=paid, at=now)
    if sim.scale_out is not None:
        sim.scale_out.append(
            ScalePoint(now, desired, len(sim.present), paid, obs.arrivals / s.interval_s)
        )
    sim.push(now + s.interval_s, "control", None)
