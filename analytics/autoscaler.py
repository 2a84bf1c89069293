"""``kvgate autoscale``: the autoscaling signal on the live pipeline.

It follows ``kvgate.heartbeats`` (which replicas serve each pool and model, their queues and KV
use) and ``kvgate.decisions`` (arrivals and admission refusals), and once per
``autoscale.interval_s`` feeds each (pool, model) its :class:`~analytics.autoscale.Observation`.
The scaler's answer is exported as the gauge ``kvgate_autoscale_desired_replicas{pool,model}``
(for KEDA's Prometheus scaler or an HPA on external metrics) and published on ``kvgate.control``
as a ``scale`` message (subject ``scale/<pool>/<model>``, compacted: the latest per pool/model).

Every message is validated (malformed ones go to the dead-letter topic); the tables it keeps are
bounded (``MAX_NODES`` heartbeats, ``MAX_KEYS`` pools × models); a Kafka outage stops the inputs
but not the loop: replicas whose heartbeats stop age out after their lease, as the routers do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from analytics.autoscale import Autoscaler, AutoscaleSettings, Observation, make_autoscaler
from streams.kafka import KafkaBus, decode_or_dead_letter, make_consumer
from streams.schemas import ControlMessage, Decision, Heartbeat
from streams.settings import KafkaSettings
from streams.topics import CONTROL, DECISIONS, HEARTBEATS

__all__ = ["AutoscaleService", "PoolState", "observations", "scale_message"]

log = logging.getLogger(__name__)

MAX_NODES = 100_000
MAX_KEYS = 1_000

Key = tuple[str, str]  # (pool, model)


@dataclass(slots=True)
class PoolState:
    """What the service has seen since its last decision."""

    nodes: dict[str, Heartbeat] = field(default_factory=dict)  # node -> latest heartbeat
    arrivals: Counter[Key] = field(default_factory=Counter)
    refusals: Counter[Key] = field(default_factory=Counter)
    dropped: int = 0  # over the bounds

    def heartbeat(self, hb: Heartbeat) -> None:
        old = self.nodes.get(hb.node_id)
        if old is not None and old.epoch == hb.epoch and old.seq >= hb.seq:
            return  # stale or duplicate
        if old is None and len(self.nodes) >= MAX_NODES:
            self.dropped += 1
            return
        self.nodes[hb.node_id] = hb

    def decision(self, d: Decision) -> None:
        key = (d.pool, d.model)
        if key not in self.arrivals and len(self.arrivals) >= MAX_KEYS:
            self.dropped += 1
            return
        self.arrivals[key] += 1
        if d.admission == "rejected":
            self.refusals[key] += 1


def observations(state: PoolState, now: float, known: Iterable[Key] = ()) -> dict[Key, Observation]:
    """One observation per (pool, model) with a live replica, traffic, or in ``known`` (a pool
    whose replicas all stopped still gets a decision): the replicas whose heartbeat is within
    its lease (healthy, not draining) serve; counters since the last call."""
    live: dict[Key, list[Heartbeat]] = {}
    for hb in state.nodes.values():
        if now - hb.ts > hb.lease_s:
            continue
        live.setdefault((hb.pool, hb.model), [])
        if hb.healthy and not hb.draining:
            live[(hb.pool, hb.model)].append(hb)
    out: dict[Key, Observation] = {}
    for key in set(live) | set(state.arrivals) | set(known):
        serving = live.get(key, [])
        kv = [hb.kv_blocks_used / hb.kv_blocks_total for hb in serving if hb.kv_blocks_total]
        out[key] = Observation(
            now=now,
            replicas=len(serving),
            arrivals=state.arrivals.get(key, 0),
            waiting=sum(hb.waiting for hb in serving),
            running=sum(hb.running for hb in serving),
            kv_used=sum(kv) / len(kv) if kv else 0.0,
            refusals=state.refusals.get(key, 0),
        )
    return out


def scale_message(
    key: Key, desired: int, obs: Observation, forecast_rps: float | None
) -> ControlMessage:
    pool, model = key
    return ControlMessage(
        subject=f"scale/{pool}/{model}",
        kind="scale",
        ts=obs.now,
        payload={
            "pool": pool,
            "model": model,
            "desired_replicas": desired,
            "serving_replicas": obs.replicas,
            "arrivals_rps": obs.arrivals,
            "forecast_rps": forecast_rps,
            "waiting": obs.waiting,
            "kv_used": round(obs.kv_used, 4),
            "refusals": obs.refusals,
        },
    )


class AutoscaleService:
    """The live loop: inputs from Kafka, one decision per interval per (pool, model)."""

    def __init__(
        self,
        kafka: KafkaSettings,
        settings: AutoscaleSettings,
        bus: KafkaBus,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.kafka = kafka
        self.settings = settings
        self.bus = bus
        self.state = PoolState()
        self.scalers: dict[Key, Autoscaler] = {}
        self.decisions = 0
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        labels = ["pool", "model"]
        self.desired = Gauge(
            "kvgate_autoscale_desired_replicas",
            "replicas the pool should have",
            labels,
            registry=reg,
        )
        self.serving = Gauge(
            "kvgate_autoscale_serving_replicas",
            "replicas serving (live heartbeats)",
            labels,
            registry=reg,
        )
        self.forecast = Gauge(
            "kvgate_autoscale_forecast_rps",
            "arrivals forecast one lead time ahead",
            labels,
            registry=reg,
        )

    def tick(self, now: float) -> list[ControlMessage]:
        """Decide for every (pool, model) and reset the counters; returns the messages."""
        s = self.settings
        out = []
        for key, obs in sorted(observations(self.state, now, self.scalers).items()):
            scaler = self.scalers.get(key)
            if scaler is None:
                scaler = self.scalers[key] = make_autoscaler(s, max(s.min_replicas, obs.replicas))
            want = scaler.observe(obs)
            ahead = getattr(scaler, "last_forecast_rps", None)
            ahead_rps = float(ahead) if ahead is not None else None
            self.desired.labels(*key).set(want)
            self.serving.labels(*key).set(obs.replicas)
            if ahead_rps is not None:
                self.forecast.labels(*key).set(ahead_rps)
            out.append(scale_message(key, want, obs, ahead_rps))
        self.state.arrivals.clear()
        self.state.refusals.clear()
        self.decisions += len(out)
        return out

    def ingest(self, items: Iterable[Any]) -> None:
        for msg in items:
            if isinstance(msg, Heartbeat):
                self.state.heartbeat(msg)
            elif isinstance(msg, Decision):
                self.state.decision(msg)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        hb_topic, dec_topic = (
            HEARTBEATS.name(self.kafka.namespace),
            DECISIONS.name(self.kafka.namespace),
        )
        specs = {hb_topic: HEARTBEATS, dec_topic: DECISIONS}
        consumer = make_consumer(
            self.kafka,
            hb_topic,
            dec_topic,
            group_id=None,
            client_id="kvgate-autoscale",
            auto_offset_reset="latest",
        )
        await consumer.start()
        next_at = time.monotonic() + self.settings.interval_s
        try:
            while stop is None or not stop.is_set():
                wait_ms = max(0, min(500, int((next_at - time.monotonic()) * 1000)))
                batches = await consumer.getmany(timeout_ms=wait_ms, max_records=5000)
                for tp, records in batches.items():
                    spec = specs[tp.topic]
                    for r in records:
                        if r.value is None:  # a retired node's tombstone
                            self.state.nodes.pop(r.key.decode() if r.key else "", None)
                            continue
                        msg = await decode_or_dead_letter(self.bus, spec, r, "autoscale")
                        if msg is not None:
                            self.ingest([msg])
                if time.monotonic() >= next_at:
                    next_at += self.settings.interval_s
                    for m in self.tick(time.time()):
                        await self.bus.publish(CONTROL, m.subject, m)
        finally:
            await consumer.stop()
