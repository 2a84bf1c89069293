"""The router's gauges, set from what it sees when ``/metrics`` is scraped: replica lag, the
agents' KV-event counters, nodes by state and by KV index kind, the largest prompt that fits now
and ever, reservations, queues, in-flight requests and budget use, the Kafka outbox, the
degraded feed."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence

from admission.exceptions import AdmissionError
from admission.failover import FailoverReservations
from admission.gate import AdmissionGate
from admission.queue import ORDER as PRIORITIES
from router.decision.candidates import budget_totals
from router.decision.fit import node_admissible_blocks, node_capacity_blocks
from router.decision.fleet import Fleet
from router.decision.types import NodeView
from router.metrics import RouterMetrics
from streams.kafka import KafkaBus
from streams.schemas import Heartbeat

__all__ = ["collect"]

_AGENT_COUNTERS = ("kv_events_undecodable", "kv_blocks_untranslatable", "kv_blocks_skipped")


def _nodes(
    m: RouterMetrics, views: Sequence[NodeView], beats: Sequence[Heartbeat], now: float
) -> None:
    m.replica_lag.set(now - max((hb.ts for hb in beats), default=now))
    m.index_gap.set(sum(v.kv_index_gap for v in views))
    m.engine_restarts.set(sum(hb.engine_restarts for hb in beats))
    m.kv_events_lost.set(sum(hb.kv_events_lost for hb in beats))
    for name in _AGENT_COUNTERS:
        m.kv_agent.labels(name).set(sum(getattr(hb, name) for hb in beats))
    for kind in ("events", "approximate", "degraded"):
        m.nodes_kv_index.labels(kind).set(sum(1 for hb in beats if hb.kv_index == kind))
    healthy = sum(1 for v in views if v.healthy and v.alive(now))
    m.nodes.labels("healthy").set(healthy)
    m.nodes.labels("unhealthy").set(len(views) - healthy)
    fits: dict[tuple[str, str], tuple[int, int]] = {}
    for v in views:
        if v.healthy and not v.draining and v.alive(now):
            where = (v.pool, m.model(v.model))
            was = fits.get(where, (0, 0))
            fits[where] = (
                max(was[0], node_admissible_blocks(v) * v.block_size),
                max(was[1], node_capacity_blocks(v) * v.block_size),
            )
    for (pool, model), (now_tokens, ever_tokens) in fits.items():
        m.fit_tokens.labels(pool, model, "now").set(now_tokens)
        m.fit_tokens.labels(pool, model, "ever").set(ever_tokens)


async def _admission(
    m: RouterMetrics,
    gate: AdmissionGate,
    views: Sequence[NodeView],
    inflight: Counter[str],
    now: float,
) -> None:
    with contextlib.suppress(AdmissionError):
        m.reservations.set(await gate.store.count())
    store = gate.store
    if isinstance(store, FailoverReservations):
        m.store_local.labels("local").set(1 if store.degraded else 0)
        m.store_local.labels("failovers").set(store.failovers)
        m.store_local.labels("held_blocks").set((await store.held_here())[0])
    batch = getattr(store, "batch", None)  # the Redis store's (admission.redis_batch)
    if batch is not None:
        m.redis_scripts.labels("calls").set(batch.calls)
        m.redis_scripts.labels("round_trips").set(batch.round_trips)
    depth: Counter[str] = Counter()
    for pool in gate.queues.pools():
        depth.update(gate.queues.depth(pool))
    for priority in PRIORITIES:
        m.inflight.labels(priority).set(inflight[priority])
        m.queue_depth.labels(priority).set(depth[priority])
    if gate.settings.enabled:
        for key, total in sorted(budget_totals(views, now).items()):
            with contextlib.suppress(AdmissionError):
                held = (await gate.store.snapshot(key, now))[0]
                m.budget_used.labels(key).set(held / total if total else 0.0)


async def collect(
    m: RouterMetrics,
    views: Sequence[NodeView],
    beats: Sequence[Heartbeat],
    fleet: Fleet,
    gate: AdmissionGate,
    bus: KafkaBus,
    feed_state: str,
    inflight: Counter[str],
    now: float,
) -> None:
    """Set every gauge (an unreachable admission store leaves its gauges where they were)."""
    _nodes(m, views, beats, now)
    for state, n in fleet.counts(views, now).items():
        m.fleet_nodes.labels(state).set(n)
    await _admission(m, gate, views, inflight, now)
    m.kafka_queued.set(bus.queued)
    for topic, n in bus.dropped.items():
        m.kafka_dropped.labels(topic).set(n)
    for topic, n in bus.refused.items():
        m.kafka_refused.labels(topic).set(n)
    for mode in ("last_known", "load_only"):
        m.degraded.labels(mode).set(1 if feed_state == mode else 0)
