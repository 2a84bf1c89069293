"""The director: one request's way through admission and routing, for every surface.

:meth:`Director.admit` takes an :class:`~router.flow.intake.Intake` through the candidates
(router/decision/candidates.py) and admission control; :meth:`Director.route` routes it through
the one pipeline (router/decision/pipeline.py), waiting in the router while the pipeline holds
it (a loose SLO class polled, the lane rules' queue) and committing it once it is sent;
:meth:`Director.reroute` sends it elsewhere after a node failed it; :meth:`Director.dry_run`
decides without learning anything. Every refusal is a :class:`~router.flow.refusals.Refusal`;
nothing here knows the transport.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import replace

from admission.core import OutputShape, Rejection, RejectReason, Verdict
from admission.gate import AdmissionGate
from admission.plan import AdmissionAsk
from router.decision.calibrate import TokenCalibration
from router.decision.candidates import budget, candidates, healthy_share
from router.decision.inflight import InflightLedger
from router.decision.outlier import Failure
from router.decision.pipeline import (
    Ask,
    Held,
    Mode,
    Refused,
    Routed,
    Rules,
    Snapshot,
    commit,
    decide,
    no_node,
)
from router.decision.placement import FREE, Placement
from router.decision.types import NodeView, RouteDecision, RouteRequest, eligible
from router.flow.asks import Gated, queue_weight, route_request
from router.flow.headers import mint_id
from router.flow.holding import until_routed
from router.flow.intake import Intake, IntakeReader, attempt_fingerprint
from router.flow.offload import OFFLOAD_TOKENS, offloaded
from router.flow.pressure import Pressure
from router.flow.recorder import Recorder
from router.flow.refusals import Refusal, rejection_status
from router.flow.scaleroom import ScaleRoom
from router.flow.served import Served
from router.flow.views import ClusterView
from router.flow.waiting import RouterQueue
from router.metrics import RouterMetrics
from router.parse import ParsedRequest
from router.settings import RouterSettings
from streams.blocks import chain_hashes, chain_root

__all__ = ["Ask", "Director"]

log = logging.getLogger(__name__)


class Director:
    def __init__(
        self,
        settings: RouterSettings,
        gate: AdmissionGate,
        views: ClusterView,
        rules: Rules,
        ledger: InflightLedger,
        queue: RouterQueue[tuple[Routed | Refused, Snapshot]],
        metrics: RouterMetrics,
        recorder: Recorder,
        reader: IntakeReader,
        calibration: TokenCalibration,
    ) -> None:
        self.settings = settings
        self.scaleroom = ScaleRoom(settings, views, metrics)
        self.gate = gate
        self.views = views
        self.rules = rules
        self.ledger = ledger
        self.queue = queue
        self.metrics = metrics
        self.recorder = recorder
        self.reader = reader
        self.calibration = calibration
        self.fleet, self.feed, self.replica = rules.fleet, views.feed, views.replica
        # whose KV is short now (someone refused or queued for it within a write timeout, the
        # longest a stall can last): stalled streams there are cut within the stall budget
        self.pressure = Pressure(settings.stream_write_timeout_s)

    def _rejected(self, rej: Rejection) -> Refusal:
        """Admission's or routing's rejection, counted."""
        self.metrics.rejected(rej.reason)
        return Refusal.of(rej)

    def _candidates(
        self, all_nodes: list[NodeView], model: str, now: float, placement: Placement = FREE
    ) -> list[NodeView] | Rejection:
        """The request's candidates (router/decision/candidates.py), or why there are none."""
        adm = self.gate.settings
        return candidates(
            all_nodes,
            model,
            now,
            self.settings.max_queue,
            adm.min_healthy_share,
            adm.min_retry_after_s,
            placement,
        )

    async def admit(self, i: Intake, hold: bool = True) -> Gated:
        """Model, node health and admission for an authenticated, parsed request: what routing
        needs (admitted requests hold a reservation from here on); raises :class:`Refusal`. A
        model scaling up from zero: it waits (``hold`` False: refused; flow/scaleroom.py)."""
        tenant, request_id, p, placement, slo = i.tenant, i.request_id, i.parsed, i.placement, i.slo
        client, idempotency_key = i.client, i.idempotency_key
        max_wait = slo[1].ttft_s if slo is not None else self.settings.scale_wait_s
        now = time.time()
        all_nodes = self.views.nodes(now)
        if await self.scaleroom.wait(p.model, max_wait, hold, all_nodes, now):
            now, all_nodes = time.time(), self.views.nodes(time.time())  # it waited
        if not any(n.serves(p.model) for n in all_nodes):
            missing = f"The model `{p.model[:200]}` does not exist."
            raise self.reader.refuse("unknown_model", 404, missing, "NotFoundError")
        nodes = self._candidates(all_nodes, p.model, now, placement)
        if healthy_share(all_nodes, p.model, now) < self.gate.settings.min_healthy_share:
            self.metrics.shed_fleet.inc()  # served by the nodes left, against their budget
        if isinstance(nodes, Rejection):
            raise self._rejected(nodes)
        block_size = nodes[0].block_size if nodes else self.settings.block_size
        pool, budget_nodes = budget(
            all_nodes, nodes, p.model, now, self.views.adapter_base, not placement.free
        )
        verdict = None
        if self.gate.settings.enabled:
            # retries of one attempt: the client's Idempotency-Key, within its tenant (or its
            # address, anonymous) only
            client = client or tenant.name
            attempt = (
                f"{client}|{idempotency_key}"
                if idempotency_key is not None
                else attempt_fingerprint(client, p)
            )
            ask = AdmissionAsk(
                request_id,
                tenant,
                # approximate tokens: scaled to what the engine counts
                # (router/decision/calibrate.py)
                p.prompt_tokens_total
                if p.exact_tokens
                else self.calibration.prompt_tokens(p.model, p.prompt_tokens_total),
                p.max_tokens,
                block_size,
                pool,
                budget_nodes,
                p.model,
                OutputShape(p.min_tokens, p.ignore_eos, p.sequences),
                slo[1].ttft_s if slo is not None else None,
                attempt,
                client,
                i.resuming,
            )
            verdict = await self.gate.screen_and_admit(ask, now)
            self.pressure.note(pool, verdict, now)
            rejection = verdict.rejection
            if rejection is not None and rejection.reason != RejectReason.RETRY_STORM:
                await self.gate.refused(attempt, rejection, now, client, tenant)
        if verdict is not None and verdict.admitted and verdict.queue_wait_s:
            now = time.time()  # it waited: route on the cluster as it is now
            fresh = self._candidates(self.views.nodes(now), p.model, now, placement)
            nodes = fresh if isinstance(fresh, list) and fresh else nodes
        return Gated(
            tenant,
            nodes,
            block_size,
            verdict,
            now,
            i.client_request_id,
            slo,
            (pool, budget_nodes),
        )

    def expected_output(self, p: ParsedRequest, tenant: str) -> int:
        """The output ``p`` is expected to produce: ``max_tokens`` capped by what the tenant's
        answers from this model have been (admission/estimate.py, learned from outcomes)."""
        return self.gate.estimator.expected(tenant, p.model, p.max_tokens, p.max_tokens)

    async def prompt_hashes(self, p: ParsedRequest, block_size: int) -> list[int]:
        """``p``'s chained block hashes (salted by its ``cache_salt`` and LoRA adapter); a long
        prompt's off the loop (router/flow/offload.py)."""
        adapter = p.model if p.model in self.views.adapter_base else None
        root = chain_root(p.cache_salt, adapter)
        if len(p.hashable) > OFFLOAD_TOKENS:
            return await offloaded(chain_hashes, p.hashable, block_size, root)
        return chain_hashes(p.hashable, block_size, root)

    def ask(
        self,
        request_id: str,
        p: ParsedRequest,
        hashes: list[int],
        g: Gated,
        started: float,
        mode: Mode,
    ) -> Ask:
        """What routing knows of ``p`` (its prompt's ``hashes``, sizes, session) and asks."""
        rreq = route_request(request_id, p, hashes, queue_weight(g.slo))
        adapter = p.model in self.views.adapter_base
        return Ask(
            rreq,
            self.expected_output(p, g.tenant.name),
            started,
            g.slo,
            hold_slo=g.verdict is not None and g.verdict.admitted,
            mode=mode,
            prewarm=not adapter,  # (an adapter's prefixes: only where it is loaded)
            exact=p.exact_tokens,
            priority=g.tenant.priority,
        )

    def snapshot(
        self, ask: Ask, nodes: Sequence[NodeView], block_size: int, now: float
    ) -> Snapshot:
        """The cluster as this router sees it now, for ``ask`` among ``nodes``."""
        load_only = self.feed.state == "load_only"  # the index is too old to claim hits on
        hashes = ask.request.block_hashes
        matches = {} if load_only else self.views.matches(hashes, now, ask.exact)
        fit_floor, roles = self.views.fit_floor, self.views.roles
        who = None if ask.mode == "query" else self.gate.preemptible  # (a dry run: never)
        return Snapshot(nodes, matches, now, block_size, load_only, fit_floor, roles, who)

    def again(self, ask: Ask, g: Gated) -> Snapshot:
        """A waiting request's snapshot now: its candidates still eligible, else its own."""
        now = time.time()
        ids = {n.node_id for n in g.nodes}
        fresh = [
            n for n in eligible(self.views.nodes(now), ask.request.model, now) if n.node_id in ids
        ]
        return self.snapshot(ask, fresh or g.nodes, g.block_size, now)

    def commit(self, ask: Ask, snap: Snapshot, routed: Routed, p: ParsedRequest) -> None:
        """``routed`` is sent: the router's state learns from it (router/decision/pipeline.py),
        and pre-warm advice leaves when its prefix is hot."""
        advice = commit(ask, snap, routed, self.rules, self.ledger)
        if routed.canary is not None:
            self.metrics.canary_routed.labels(routed.canary).inc()
        if advice is not None:
            self.recorder.advise(advice, p, snap.block_size, snap.now)

    async def route(
        self,
        request_id: str,
        p: ParsedRequest,
        g: Gated,
        started: float,
        t0: float,
        mode: Mode = "proxy",
    ) -> tuple[Ask, RouteDecision, NodeView]:
        """Route (router/decision/pipeline.py: waiting in the router while it says so),
        record the decision, and either refuse (a response) or name the node; the request
        then counts in this router's in-flight ledger until ``ledger.finish``."""
        tenant, block_size, verdict = g.tenant, g.block_size, g.verdict
        ask = self.ask(request_id, p, await self.prompt_hashes(p, block_size), g, started, mode)
        waited = verdict.queue_wait_s if verdict is not None and verdict.queue_wait_s else 0.0
        got: Routed | Refused | None = None
        if verdict is not None and not verdict.admitted:
            decision = RouteDecision(None, "admission_rejected", ())
        else:
            snap = self.snapshot(ask, g.nodes, block_size, g.now)
            start = time.time()
            first = decide(ask, snap, self.rules)
            got, snap, committed = await until_routed(self, ask, g, first, snap, p)
            waited += time.time() - start if got is not None else 0.0
            decision = got.decision
            if isinstance(got, Refused) and decision.reason == "deadline":
                self.metrics.slo.labels(g.slo[0] if g.slo else "", "refused").inc()
                verdict = Verdict(False, verdict.kv_blocks if verdict else 0, 1.0, got.rejection)
            elif isinstance(got, Routed) and not committed:
                self.commit(ask, snap, got, p)
        decision_us = max(0.0, (time.perf_counter() - t0 - waited) * 1e6)  # without the queue
        self.metrics.decided(decision.reason, decision_us)
        if waited:
            self.metrics.queue_wait.labels(tenant.priority).observe(waited)
        # the record is built on the loop's next turn, once this task has sent the request
        # upstream: it never delays the first token (the outbox keeps the order it is handed)
        asyncio.get_running_loop().call_soon(
            self.recorder.decision,
            ask.request,
            p,
            decision,
            decision_us,
            started,
            block_size,
            tenant,
            verdict,
            g.client_request_id,
        )
        rej = verdict.rejection if verdict is not None else None
        if rej is None and isinstance(got, Refused):
            rej = got.rejection
        if rej is not None or decision.chosen is None:
            rej = rej or no_node(decision.reason, ask.request.prompt_tokens, self.gate.settings)
            if verdict is not None and verdict.rejection is not None:
                self.metrics.rejected(rej.reason)
            error = rej.message if verdict is not None and verdict.rejection else decision.reason
            relay = Served(status="rejected", http_status=rejection_status(rej), error=error)
            await self.recorder.outcome(request_id, None, relay, p, started)
            raise Refusal.of(rej)
        node = next(n for n in g.nodes if n.node_id == decision.chosen)
        return ask, decision, node

    def reroute(
        self, ask: Ask, g: Gated, failed: Collection[str], p: ParsedRequest, why: str = "reroute"
    ) -> NodeView | None:
        """The request's nodes ``failed`` it before any byte reached the client (``why``
        ``resume``: mid-stream, the rest of its answer is asked for): the best other
        candidate, through the same pipeline (fit, roles, fleet, a degraded feed's fallback) on
        the cluster as it is now, sent whole (no P/D split, no waiting: ``gateway`` mode);
        None when no other node may take it. The new decision is recorded (reason
        ``<why>/<reason>``, its sequence: the failed nodes so far) and committed."""
        snap = self.again(ask, g)
        others = [n for n in snap.nodes if n.node_id not in failed]
        if not others:
            return None
        snap = replace(snap, nodes=others)
        again = replace(ask, mode="gateway")
        got = decide(again, snap, self.rules)
        if not isinstance(got, Routed):
            return None
        self.commit(again, snap, got, p)
        if why == "reroute":
            self.metrics.reroutes.inc()
        d = got.decision
        self.recorder.decision(
            ask.request,
            p,
            replace(d, reason=f"{why}/{d.reason}"),
            0.0,
            ask.arrived_s,
            g.block_size,
            g.tenant,
            g.verdict,
            g.client_request_id,
            decision_seq=len(failed),
        )
        return next((n for n in g.nodes if n.node_id == d.chosen), None)

    def observe(self, node: str, failure: Failure | None, cancelled: bool = False) -> None:
        """An engine's answer to a request (outlier ejection): ``failure`` None is a success;
        a request the client gave up says nothing about the engine."""
        if cancelled and failure is None:
            return
        cause = self.fleet.detector.observe(node, failure, time.time(), len(self.replica.load))
        if cause is not None:
            self.metrics.ejections.labels(cause.removeprefix("probe_")).inc()
            h = self.fleet.detector.nodes[node]
            log.warning(
                "node %s ejected (%s) for %.0f s (ejection %d)",
                node,
                cause,
                (h.ejected_until or 0.0) - time.time(),
                h.ejections,
            )

    async def dry_run(
        self, p: ParsedRequest, now: float
    ) -> tuple[RouteRequest, RouteDecision, list[NodeView], int]:
        """What the router would do with ``p`` now (mode ``query``: no hold, nothing learned,
        nothing recorded or reserved): its request, the decision, the eligible nodes and the
        block size. A 404 for a model no node serves."""
        all_nodes = self.views.nodes(now)
        if not any(n.serves(p.model) for n in all_nodes):
            raise Refusal(404, f"The model `{p.model[:200]}` does not exist.", "NotFoundError")
        nodes = eligible(all_nodes, p.model, now)
        block_size = nodes[0].block_size if nodes else self.settings.block_size
        rreq = route_request(mint_id(), p, await self.prompt_hashes(p, block_size))
        expected = self.expected_output(p, "")
        ask = Ask(rreq, expected, now, mode="query", prewarm=False, exact=p.exact_tokens)
        got = decide(ask, self.snapshot(ask, nodes, block_size, now), self.rules)
        d = got.now.decision if isinstance(got, Held) else got.decision
        return rreq, d, nodes, block_size
