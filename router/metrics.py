"""The router's own Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["RouterMetrics"]


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._decisions = Counter(
            "kvgate_router_decisions",
            "Routing decisions by reason",
            ["reason"],
            registry=self.registry,
        )
        self._rejections = Counter(
            "kvgate_router_rejections",
            "Requests refused by reason",
            ["reason"],
            registry=self.registry,
        )
        self._outcomes = Counter(
            "kvgate_router_outcomes",
            "Finished requests by status",
            ["status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "kvgate_router_decision_seconds",
            "Admission + routing decision time",
            buckets=(50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 1e-2),
            registry=self.registry,
        )

        self.reroutes = Counter(
            "kvgate_router_reroutes",
            "Requests re-routed once after their node refused them before any byte",
            registry=self.registry,
        )
        self.prewarm_advice = Counter(
            "kvgate_router_prewarm_advice",
            "Pre-warm advice published for hot prefixes",
            registry=self.registry,
        )
        self.replica_lag = Gauge(
            "kvgate_router_replica_lag_seconds",
            "Age of the newest heartbeat in this router's replica (how far behind it runs)",
            registry=self.registry,
        )
        self.index_gap = Gauge(
            "kvgate_router_index_gap_batches",
            "KV batches nodes announced that this router's index has not applied yet",
            registry=self.registry,
        )
        self.nodes = Gauge(
            "kvgate_router_nodes",
            "Nodes in this router's replica, by health",
            ["state"],
            registry=self.registry,
        )
        self.engine_restarts = Gauge(
            "kvgate_router_engine_restarts",
            "Engine restarts the nodes' agents reported (sum over nodes in the replica; per node "
            "in /v1/kvgate/state)",
            registry=self.registry,
        )
        self.kv_events_lost = Gauge(
            "kvgate_router_kv_events_lost",
            "Engine KV event batches the nodes' agents lost (sum over nodes in the replica)",
            registry=self.registry,
        )
        self.nodes_kv_index = Gauge(
            "kvgate_router_nodes_kv_index",
            "Nodes by where their prefix index comes from: events, approximate (no events), "
            "degraded (events expected but not arriving or not translating)",
            ["kv_index"],
            registry=self.registry,
        )
        self.kv_agent = Gauge(
            "kvgate_router_kv_agent",
            "What the nodes' agents report of their engines' KV events (sums over nodes): "
            "kv_events_undecodable, kv_blocks_untranslatable, kv_blocks_skipped",
            ["counter"],
            registry=self.registry,
        )
        self.reservations = Gauge(
            "kvgate_router_reservations",
            "Reservations held in the store (all routers sharing it)",
            registry=self.registry,
        )

        self.kafka_queued = Gauge(
            "kvgate_router_kafka_queued",
            "Decision, outcome, ledger and control messages waiting for Kafka (the outbox)",
            registry=self.registry,
        )
        self.kafka_dropped = Gauge(
            "kvgate_router_kafka_dropped",
            "Messages dropped because the Kafka outbox was full, by topic",
            ["topic"],
            registry=self.registry,
        )
        self.degraded = Gauge(
            "kvgate_router_degraded",
            "1 while the router serves without a live feed: last_known (its last view) or "
            "load_only (its own load count over probed nodes)",
            ["mode"],
            registry=self.registry,
        )
        self.refusals_unrecorded = Counter(
            "kvgate_router_refusals_unrecorded",
            "Refusals before admission beyond refusal_records_per_s: counted, not recorded",
            registry=self.registry,
        )
        self.token_checks = Counter(
            "kvgate_tokenization_checks",
            "Requests whose token ids were compared with the engine's /tokenize",
            ["model"],
            registry=self.registry,
        )
        self.token_mismatches = Counter(
            "kvgate_tokenization_mismatches",
            "Of those, the ones where the engine's token ids differed from the router's",
            ["model"],
            registry=self.registry,
        )
        self.stalled_clients = Counter(
            "kvgate_router_stalled_clients",
            "Streams cut off because the client stopped reading or the request ran too long",
            registry=self.registry,
        )

    def decided(self, reason: str, decision_us: float) -> None:
        self._decisions.labels(reason).inc()
        self._latency.observe(decision_us / 1e6)

    def rejected(self, reason: str) -> None:
        self._rejections.labels(reason).inc()

    def outcome(self, status: str) -> None:
        self._outcomes.labels(status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
