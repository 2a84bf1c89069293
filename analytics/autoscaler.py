"""``kvgate autoscale``: the autoscaling signal on the live pipeline.

It follows ``kvgate.heartbeats`` (which replicas serve each pool and model, their queues and KV
use) and ``kvgate.decisions`` (arrivals and admission refusals), and once per
``autoscale.interval_s`` feeds each (pool, model) its :class:`~analytics.autoscale.Observation`.
The scaler's answer is exported as the gauge ``kvgate_autoscale_desired_replicas{pool,model}``
(for KEDA's Prometheus scaler or an HPA on external metrics) and published on ``kvgate.control``
as a ``scale`` message (subject ``scale/<pool>/<model>``, compacted: the latest per pool/model).

A restarted service does not start blind: :func:`load_history` rebuilds each (pool, model)'s
arrival history from the decision log in ClickHouse (every decision is one arrival, as in the live
count), so the trend — and the seasonality once two seasons are on record — survives a restart.
ClickHouse unreachable or slow (``history_timeout_s``): the service starts cold and says so.

Every message is validated (malformed ones go to the dead-letter topic); the tables it keeps are
bounded (``MAX_NODES`` heartbeats, ``MAX_KEYS`` pools × models); a Kafka outage stops the inputs
but not the loop: replicas whose heartbeats stop age out after their lease, as the routers do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from analytics.autoscale import (
    Autoscaler,
    AutoscaleSettings,
    Observation,
    Predictive,
    history_intervals,
    make_autoscaler,
)
from streams.kafka import KafkaBus, decode_or_dead_letter, make_consumer
from streams.schemas import ControlMessage, Decision, Heartbeat
from streams.settings import KafkaSettings
from streams.topics import CONTROL, DECISIONS, HEARTBEATS

__all__ = [
    "AutoscaleService",
    "PoolState",
    "arrival_history",
    "history_query",
    "load_history",
    "observations",
    "scale_message",
]

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


def history_query(db: str, interval_s: float, since: float, until: float) -> str:
    """Decisions per (pool, model) and interval bucket (``floor(ts / interval_s)``) in
    ``[since, until)``; a request decided twice (redelivered) counts once."""
    if not db.isidentifier():
        raise ValueError(f"bad database name {db!r}")
    step = max(1, round(interval_s * 1000))
    return (
        f"SELECT pool, model, intDiv(toUnixTimestamp64Milli(ts), {step}) AS bucket, "
        f"uniqExact(request_id) AS n FROM {db}.decisions "
        f"WHERE ts >= fromUnixTimestamp64Milli(toInt64({int(since * 1000)})) "
        f"AND ts < fromUnixTimestamp64Milli(toInt64({int(until * 1000)})) "
        "GROUP BY pool, model, bucket ORDER BY pool, model, bucket"
    )


def arrival_history(
    rows: Iterable[dict[str, Any]], interval_s: float, since: float, until: float
) -> dict[Key, list[float]]:
    """The rows of :func:`history_query` as one arrival rate per interval, oldest first, from
    ``since`` to ``until``: an interval with no decision is a zero (a quiet night is history
    too). Malformed rows are skipped; at most ``MAX_KEYS`` pools × models."""
    step = max(1, round(interval_s * 1000))
    first, last = int(since * 1000) // step, int(until * 1000) // step
    counts: dict[Key, dict[int, int]] = {}
    for row in rows:
        try:
            key = (str(row["pool"]), str(row["model"]))
            bucket, n = int(row["bucket"]), int(row["n"])
        except (KeyError, TypeError, ValueError):
            continue
        if not first <= bucket < last or n < 0:
            continue
        if key not in counts and len(counts) >= MAX_KEYS:
            continue
        counts.setdefault(key, {})[bucket] = n
    return {
        key: [by.get(b, 0) / interval_s for b in range(first, last)] for key, by in counts.items()
    }


async def load_history(
    query: Callable[[str], list[dict[str, Any]]],
    db: str,
    s: AutoscaleSettings,
    now: float,
    timeout_s: float = 10.0,
) -> dict[Key, list[float]]:
    """The arrival history of every (pool, model) from the decision log, up to the last whole
    interval before ``now``.
    ``query`` runs one SQL statement (in a thread: it may block, e.g. open a store and close
    it); the history is empty (and logged) when it fails or takes longer than ``timeout_s``."""
    until = (now // s.interval_s) * s.interval_s  # the last whole interval: no partial count
    since = until - history_intervals(s) * s.interval_s
    sql = history_query(db, s.interval_s, since, until)
    try:
        rows = await asyncio.wait_for(asyncio.to_thread(query, sql), timeout_s)
    except Exception as exc:  # any failure of the store: start cold, never block the signal
        log.warning("autoscale: no arrival history from ClickHouse (%r); starting cold", exc)
        return {}
    history = arrival_history(rows, s.interval_s, since, until)
    log.info(
        "autoscale: arrival history of %d pool/model(s), %d intervals each",
        len(history),
        history_intervals(s),
    )
    return history


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
        self.history: dict[Key, list[float]] = {}  # recorded arrivals, for scalers not yet made
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
        known = set(self.scalers) | set(self.history)
        for key, obs in sorted(observations(self.state, now, known).items()):
            scaler = self.scalers.get(key)
            if scaler is None:
                scaler = self.scalers[key] = make_autoscaler(s, max(s.min_replicas, obs.replicas))
                recorded = self.history.pop(key, None)
                if recorded and isinstance(scaler, Predictive):
                    scaler.seed(recorded)
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

    def seed(self, history: dict[Key, list[float]]) -> None:
        """Recorded arrival histories (:func:`load_history`): each (pool, model) gets its own
        when its scaler is made, and is decided from the first interval (a pool whose replicas
        all stopped while the service was down still gets a decision)."""
        for key, rates in list(history.items())[:MAX_KEYS]:
            if key not in self.scalers:
                self.history[key] = rates

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
