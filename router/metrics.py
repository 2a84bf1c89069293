"""The router's own Prometheus metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["MAX_MODELS", "BoundedLabels", "RouterMetrics"]

MAX_MODELS = 32


class BoundedLabels:
    """Label values for an unbounded set (model names come from requests): the first ``limit``
    distinct values are kept, the rest share ``other`` — a series per value, never unbounded."""

    def __init__(self, limit: int, other: str = "other") -> None:
        self.limit, self.other = limit, other
        self._seen: set[str] = set()

    def get(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        return self.other


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
            "Admission + routing decision time, without the time queued for admission",
            buckets=(50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 1e-2),
            registry=self.registry,
        )

        self.reroutes = Counter(
            "kvgate_router_reroutes",
            "Requests re-routed once after their node refused them before any byte",
            registry=self.registry,
        )
        self.scale_waiting = Gauge(
            "kvgate_router_scale_waiting",
            "Requests waiting for a node of their model to be ready (a pool scaling up from zero)",
            registry=self.registry,
        )
        self.scale_wait = Histogram(
            "kvgate_router_scale_wait_seconds",
            "How long requests waited for their model's first ready node, by how it ended",
            ["result"],
            buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.resumes = Counter(
            "kvgate_router_stream_resumes",
            "Streams whose engine failed mid-answer: continued on another node (resumed), or "
            "ended with an error event (failed: not continuable, no other node, attempts spent)",
            ["result"],
            registry=self.registry,
        )
        self.preemptions = Counter(
            "kvgate_router_preemptions",
            "Requests of a sheddable priority ended before their first token (503 preempted) "
            "to make room for a higher class that would have missed its deadline",
            ["priority"],
            registry=self.registry,
        )
        self.prewarm_advice = Counter(
            "kvgate_router_prewarm_advice",
            "Pre-warm advice published for hot prefixes",
            registry=self.registry,
        )
        self._cluster()
        self._routing()
        self._requests()

    def _cluster(self) -> None:
        """The cluster as the router sees it: replica, nodes, KV index, stores, Kafka."""
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
        self.fit_tokens = Gauge(
            "kvgate_router_fit_tokens",
            "The largest prompt one node of the pool and model can take: now (free plus "
            "evictable KV, less the watermark: larger ones get 503 Retry-After) or ever (its "
            "whole KV: larger ones get 413)",
            ["pool", "model", "when"],
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
        self.store_local = Gauge(
            "kvgate_router_admission_store_local",
            "What this router admits against: kind=local 1 while the shared reservation store "
            "is away (admitting within its share of the budget), kind=failovers the times it "
            "went local since start, kind=held_blocks the KV blocks of the reservations it holds",
            ["kind"],
            registry=self.registry,
        )
        self.redis_scripts = Gauge(
            "kvgate_router_redis_scripts",
            "Reservation and release scripts sent to Redis since start (kind=calls) and the "
            "round trips that carried them (kind=round_trips: calls of one loop turn share one)",
            ["kind"],
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
        self.kafka_refused = Gauge(
            "kvgate_router_kafka_refused",
            "Messages the broker will never take (too large), set aside, by topic",
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

    def _routing(self) -> None:
        """Routing's own counters: refusals, token checks, the fleet, holds, P/D, canary."""
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
        self.ejections = Counter(
            "kvgate_router_ejections",
            "Nodes ejected for what this router saw them do (consecutive_5xx, "
            "consecutive_timeout, consecutive_connect, success_rate, probe)",
            ["cause"],
            registry=self.registry,
        )
        self.shed_fleet = Counter(
            "kvgate_router_degraded_fleet_requests",
            "Requests that arrived while less than admission.min_healthy_share of their "
            "model's KV capacity was healthy and not backed up: admitted against what is left",
            registry=self.registry,
        )
        self.fleet_nodes = Gauge(
            "kvgate_router_fleet_nodes",
            "Nodes out of (or limited in) rotation on this router: drained, ejected, probing, "
            "slow_start, canary",
            ["state"],
            registry=self.registry,
        )
        self.slo = Counter(
            "kvgate_router_slo_requests",
            "Requests with an SLO class by outcome: met (TTFT and TPOT within the class's "
            "targets), missed, refused (deadline: it could not have met its TTFT)",
            ["slo_class", "outcome"],
            registry=self.registry,
        )
        self.held = Gauge(
            "kvgate_router_held_requests",
            "Admitted requests of a loose SLO class waiting in the router for the engines' "
            "queues to drain (hold_queue_s)",
            registry=self.registry,
        )
        self.holds = Counter(
            "kvgate_router_holds",
            "Admitted requests held in the router at least once for their SLO class",
            registry=self.registry,
        )
        self.lane_held = Gauge(
            "kvgate_router_lane_queue_requests",
            "Requests waiting in the router's queue while the engines are queued (lane rules, "
            "router/decision/lanes.py)",
            registry=self.registry,
        )
        self.lane_holds = Counter(
            "kvgate_router_lane_holds",
            "Requests that waited in the router's queue, by lane: long (long prompt or long "
            "expected output) or short",
            ["lane"],
            registry=self.registry,
        )
        self.kv_pulls = Counter(
            "kvgate_router_kv_pulls",
            "Requests sent to a node that loads their prefix's KV from its holder "
            "(router/decision/pull.py), by outcome of the holder's leg: ok (the KV was offered), "
            "fallback (the node computed the prompt itself)",
            ["outcome"],
            registry=self.registry,
        )
        self.disaggregated = Counter(
            "kvgate_router_disaggregated",
            "Requests split over a prefill and a decode node, by outcome of the prefill leg: "
            "ok (the decode node received the KV), fallback (it computed the prompt itself)",
            ["outcome"],
            registry=self.registry,
        )
        self.canary_routed = Counter(
            "kvgate_router_canary_requests",
            "Requests that fell in a canary group's share",
            ["group"],
            registry=self.registry,
        )
        self.stalled_clients = Counter(
            "kvgate_router_stalled_clients",
            "Streams cut off because the client stopped reading or the request ran too long",
            registry=self.registry,
        )

    def _requests(self) -> None:
        """Requests by model, queues, in-flight requests and budgets."""
        # request latencies and tokens, per model (at most MAX_MODELS label values)
        self._models = BoundedLabels(MAX_MODELS)
        self._per_model: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._per_reason: dict[str, Any] = {}  # decisions' counters by reason (a bounded set)
        self.ttft = Histogram(
            "kvgate_router_ttft_seconds",
            "Time to first token, from the router's receipt of the request",
            ["model"],
            buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.tpot = Histogram(
            "kvgate_router_tpot_seconds",
            "Time per output token after the first",
            ["model"],
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64),
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvgate_router_request_duration_seconds",
            "End-to-end request time at the router, by outcome",
            ["model", "status"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900),
            registry=self.registry,
        )
        self.tokens = Counter(
            "kvgate_router_tokens",
            "Tokens of finished requests: prompt, generated, and prompt tokens the engine had "
            "cached",
            ["model", "kind"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "kvgate_router_admission_queue_wait_seconds",
            "Time a request waited in the admission queue (admitted or refused after waiting)",
            ["priority"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "kvgate_router_admission_queue_depth",
            "Requests waiting in this router's admission queue, by priority",
            ["priority"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "kvgate_router_inflight_requests",
            "Requests this router is serving now (admitted, not finished), by priority",
            ["priority"],
            registry=self.registry,
        )
        self.budget_used = Gauge(
            "kvgate_router_kv_budget_used_ratio",
            "Share of a pool's KV budget held by reservations (all routers sharing the store)",
            ["pool"],
            registry=self.registry,
        )

    def model(self, name: str) -> str:
        """``name`` as a label value: the first MAX_MODELS models seen keep theirs."""
        return self._models.get(name)

    def finished(
        self,
        model: str,
        status: str,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int | None,
    ) -> None:
        """A finished request's latencies and tokens (what its outcome record says)."""
        m = self.model(model)
        c = self._per_model.get((m, status))
        if c is None:  # the label children, looked up once per model and status
            c = self._per_model[(m, status)] = (
                self.ttft.labels(m),
                self.tpot.labels(m),
                self.e2e.labels(m, status),
                self.tokens.labels(m, "prompt"),
                self.tokens.labels(m, "generated"),
                self.tokens.labels(m, "cached"),
                self._outcomes.labels(status),
            )
        ttft, tpot, e2e, prompt, generated, cached, outcome = c
        outcome.inc()
        if ttft_s is not None:
            ttft.observe(ttft_s)
        if tpot_s is not None:
            tpot.observe(tpot_s)
        e2e.observe(e2e_s)
        prompt.inc(prompt_tokens)
        generated.inc(output_tokens)
        if cached_tokens:
            cached.inc(cached_tokens)

    def decided(self, reason: str, decision_us: float) -> None:
        counter = self._per_reason.get(reason)
        if counter is None:
            counter = self._per_reason[reason] = self._decisions.labels(reason)
        counter.inc()
        self._latency.observe(decision_us / 1e6)

    def rejected(self, reason: str) -> None:
        self._rejections.labels(reason).inc()

    def outcome(self, status: str) -> None:
        self._outcomes.labels(status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
