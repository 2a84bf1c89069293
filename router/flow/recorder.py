"""What the router records: decisions, outcomes and refusals on the Kafka topics (with their
metrics), and pre-warm advice on the control topic. Publishing never waits on the broker for a
decision (the outbox keeps the order it is handed); refusals before admission are rate-limited
so that a flood of junk cannot crowd real decisions out."""

from __future__ import annotations

import time
from typing import Literal

from admission.core import Verdict
from admission.settings import Tenant
from admission.slo import Slo
from router.decision.hotprefix import PrewarmAdvice
from router.decision.types import NodeView, Policy, RouteDecision, RouteRequest
from router.flow.served import Served
from router.flow.views import ClusterView
from router.metrics import RouterMetrics
from router.parse import ParsedRequest
from router.records import (
    admission_fields,
    decision_fields,
    listing_record,
    outcome_fields,
    passthrough_outcome,
    passthrough_record,
    refusal_record,
)
from router.settings import RouterSettings
from streams.kafka import KafkaBus
from streams.schemas import ControlMessage, Decision, Outcome, PassthroughKind
from streams.topics import CONTROL, DECISIONS, OUTCOMES
from streams.trusted import Shape, record_json

__all__ = ["Recorder"]

DECISION = Shape(Decision)
OUTCOME = Shape(Outcome)


class _TokenBucket:
    """At most ``rate`` a second, bursts of twice that."""

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.at = rate, 2 * rate, 0.0

    def take(self, now: float) -> bool:
        self.tokens = min(2 * self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Recorder:
    def __init__(
        self,
        settings: RouterSettings,
        bus: KafkaBus,
        router_id: str,
        policy: Policy,
        views: ClusterView,
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.router_id = router_id
        self.policy = policy
        self.views = views
        self.replica = views.replica
        self.metrics = metrics
        self._bucket = _TokenBucket(settings.refusal_records_per_s)

    def refusal(
        self,
        request_id: str,
        started: float,
        reason: str,
        tenant: str,
        parsed: ParsedRequest | None,
        client_request_id: str | None,
    ) -> None:
        """A decision record for a request refused before admission (bad input, no or wrong
        credentials, unknown model, unhealthy cluster), at most ``refusal_records_per_s``
        (a flood of junk must not crowd real decisions out of the Kafka outbox)."""
        if not self._bucket.take(started):
            self.metrics.refusals_unrecorded.inc()
            return
        record = refusal_record(
            request_id,
            started,
            reason,
            parsed,
            router_id=self.router_id,
            tenant=tenant,
            policy=self.policy.name,
            weights_version=self.policy.weights_version,
            block_size=self.settings.block_size,
            client_request_id=client_request_id,
        )
        self.bus.post(DECISIONS, request_id, record)

    def advise(self, advice: PrewarmAdvice, p: ParsedRequest, block_size: int, now: float) -> None:
        """Publish pre-warm advice: the named nodes' agents load the prefix into their engine."""
        self.metrics.prewarm_advice.inc()
        msg = ControlMessage(
            subject=f"prewarm/{advice.prefix_hash:016x}",
            kind="prewarm",
            ts=now,
            payload={
                "model": p.model,
                "prefix_hash": advice.prefix_hash,
                "blocks": advice.blocks,
                "block_size": block_size,
                "share": round(advice.share, 4),
                "holders": list(advice.holders),
                "nodes": list(advice.targets),
                "prompt_token_ids": p.tokens[: advice.blocks * block_size],
                # the engine hashes it into the first block: the warmed prefix is the salted one
                "cache_salt": p.cache_salt,
                "router_id": self.router_id,
            },
        )
        self.bus.post(CONTROL, msg.subject, msg)
        # advice is for now: its tombstone lets compaction remove it from the control topic
        self.bus.post(CONTROL, msg.subject, None)

    def decision(
        self,
        rreq: RouteRequest,
        p: ParsedRequest,
        d: RouteDecision,
        decision_us: float,
        started: float,
        block_size: int,
        tenant: Tenant,
        verdict: Verdict | None,
        client_request_id: str | None = None,
        decision_seq: int = 0,
    ) -> None:
        ages = [
            started - self.replica.index_updated_s.get(c.node_id, started)
            for c in d.candidates
            if c.hit_blocks
        ]
        fields = decision_fields(
            rreq,
            p,
            d,
            router_id=self.router_id,
            policy=self.policy.name,
            weights_version=(
                d.weights_version if d.weights_version is not None else self.policy.weights_version
            ),
            started=started,
            block_size=block_size,
            decision_us=decision_us,
            index_age_s=max(ages) if ages else None,
            approximate_nodes=self.views.approx_nodes,
            tenant=tenant.name,
            priority=tenant.priority,
            **admission_fields(verdict),
            client_request_id=client_request_id,
            decision_seq=decision_seq,
        )
        self.bus.post_json(DECISIONS, rreq.request_id, record_json(DECISION, fields))

    def listing(
        self, request_id: str, tenant: Tenant, block_size: int, client_request_id: str | None
    ) -> None:
        """``GET /v1/models``'s decision record (answered here, no engine)."""
        self.bus.post(
            DECISIONS,
            request_id,
            listing_record(
                request_id,
                router_id=self.router_id,
                tenant=tenant.name,
                priority=tenant.priority,
                started=time.time(),
                block_size=block_size,
                client_request_id=client_request_id,
            ),
        )

    def passthrough(
        self,
        request_id: str,
        kind: PassthroughKind,
        model: str,
        tenant: Tenant,
        node: NodeView,
        started: float,
        client_request_id: str | None = None,
        verdict: Verdict | None = None,
    ) -> None:
        """A request of a non-generating endpoint for ``node`` (router/http/passthrough.py):
        its decision record, admission's ``verdict`` in it (None: admission off)."""
        self.bus.post(
            DECISIONS,
            request_id,
            passthrough_record(
                request_id,
                kind,
                model,
                node,
                verdict,
                router_id=self.router_id,
                tenant=tenant.name,
                priority=tenant.priority,
                started=started,
                client_request_id=client_request_id,
            ),
        )

    def passthrough_outcome(
        self,
        request_id: str,
        node: NodeView,
        status: Literal["ok", "error", "cancelled"],
        http_status: int,
        started: float,
        error: str | None = None,
    ) -> None:
        """What became of a pass-through request (:meth:`passthrough`): no tokens counted."""
        record = passthrough_outcome(
            request_id,
            node,
            status,
            http_status,
            router_id=self.router_id,
            started=started,
            now=time.time(),
            error=error,
        )
        self.bus.post(OUTCOMES, request_id, record)

    async def outcome(
        self,
        request_id: str,
        node: str | None,
        relay: Served,
        p: ParsedRequest,
        started: float,
        reroutes: int = 0,
        slo: Slo | None = None,
        resumes: int = 0,
    ) -> None:
        o = outcome_fields(
            request_id,
            node,
            relay,
            p,
            router_id=self.router_id,
            started=started,
            now=time.time(),
            reroutes=reroutes,
            resumes=resumes,
        )
        status, ttft, tpot = o["status"], o["ttft_s"], o["tpot_s"]
        self.metrics.finished(
            p.model,
            status,
            ttft,
            tpot,
            o["e2e_s"],
            o["prompt_tokens"],
            o["output_tokens"],
            o["cached_tokens"],
        )
        if slo is not None and status != "cancelled":
            name, cls = slo
            met = (
                status == "ok"
                and ttft is not None
                and ttft <= cls.ttft_s
                and (tpot is None or tpot <= cls.tpot_s)
            )
            self.metrics.slo.labels(name, "met" if met else "missed").inc()
        self.bus.post_json(OUTCOMES, request_id, record_json(OUTCOME, o))
