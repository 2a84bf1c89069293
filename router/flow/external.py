"""Requests another forwarder carries: a gateway through the gateway API, or this router's
endpoint picker for Envoy. The router admits and routes them like its own (the pipeline's
``gateway`` mode: no P/D split, no waiting in the router), holds their reservation and in-flight
entry as a :class:`~router.flow.flight.Flight` with its owner, learns from their first token and
their end, and records their outcome."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from admission.gate import AdmissionGate
from router.decision.calibrate import TokenCalibration
from router.decision.inflight import InflightLedger
from router.decision.types import NodeView, RouteDecision, RouteRequest
from router.flow.director import Director
from router.flow.entry import Taken
from router.flow.flight import EPP, Flight, Flights
from router.flow.recorder import Recorder
from router.flow.served import Served
from router.flow.sessions import SessionKeeper
from router.flow.views import ClusterView
from router.flow.waiting import RouterQueue
from router.parse import ParsedRequest
from router.settings import RouterSettings

__all__ = ["ExternalRequests"]


class ExternalRequests:
    def __init__(
        self,
        settings: RouterSettings,
        gate: AdmissionGate,
        director: Director,
        flights: Flights,
        ledger: InflightLedger,
        views: ClusterView,
        recorder: Recorder,
        queue: RouterQueue[Any],
        calibration: TokenCalibration,
        on_routed: Callable[[NodeView, ParsedRequest], None] = lambda node, p: None,
        sessions: SessionKeeper | None = None,
    ) -> None:
        self.settings = settings
        self.gate = gate
        self.director = director
        self.flights = flights
        self.ledger = ledger
        self.views = views
        self.recorder = recorder
        self.queue = queue
        self.calibration = calibration
        self.on_routed = on_routed  # (the router's occasional tokenization check)
        self.sessions = sessions

    async def route(
        self,
        gateway: str,
        taken: Taken,
        allowed: Callable[[NodeView], bool] | None = None,
    ) -> tuple[str, RouteRequest, RouteDecision, NodeView, ParsedRequest]:
        """Route an admitted request that ``gateway`` forwards itself: the decision is recorded
        and the request is held (reservation, in-flight ledger) until :meth:`finish`
        or its lease runs out. A refusal releases what was held. ``allowed``: only those nodes
        (a gateway's subset hint; none of them eligible is a 503)."""
        request_id, started, p, g = taken.request_id, taken.started, taken.parsed, taken.gated
        if allowed is not None:
            g = replace(g, nodes=[n for n in g.nodes if allowed(n)])
        tenant = g.tenant
        admitted = taken.admitted
        try:
            # a gateway sends the request to one endpoint itself and waits for the answer: no
            # two-leg disaggregated flow, no waiting in this router (the pipeline's gateway mode)
            routed = await self.director.route(request_id, p, g, started, taken.t0, "gateway")
        except BaseException:
            if admitted:
                await self.gate.release(request_id, time.time())
            raise
        ask, decision, node = routed
        rreq = ask.request
        self.on_routed(node, p)
        held = self.gate.held.get(request_id)
        if gateway == EPP:  # renewed by this router while the stream is open, at most this long
            until = started + self.settings.max_stream_s
        else:  # the gateway's lease: it renews it, or the router ends the request
            until = held.expires_at if held is not None else started + self.gate.settings.lease_s
        flight = Flight(
            request_id,
            node.node_id,
            gateway,
            p,
            list(rreq.block_hashes),
            tenant,
            started,
            g.slo,
            until,
            admitted,
        )
        self.flights.add(flight)
        return request_id, rreq, decision, node, p

    def served_by(self, rid: str, node: NodeView) -> None:
        """The gateway sent ``rid`` to ``node`` (a fallback it was given) instead of the node
        routed to: the request is counted there from now on, and its outcome names it."""
        f = self.flights.get(rid)
        if f is None or f.node == node.node_id:
            return
        f.node = node.node_id
        self.ledger.moved(rid, node.node_id, time.time())

    def first_token(self, rid: str) -> None:
        """The first token of a request the EPP watches came back: its prefill is done (the
        in-flight ledger's backlog drops and, streamed, the node's prefill rate is learned) and
        its node holds the prompt from now on."""
        f = self.flights.get(rid)
        if f is None or f.first_token_s is not None:
            return
        now = time.time()
        f.first_token_s = now
        self.ledger.first_token(rid, now, learn=f.parsed.stream)
        self.views.prefilled(f.node, f.hashes, f.parsed.exact_tokens)

    async def finish(
        self,
        rid: str,
        status: Literal["ok", "error", "cancelled"],
        output_tokens: int,
        ttft: float | None,
        cached: int | None,
        prompt_tokens: int | None,
        expired: bool = False,
    ) -> bool:
        """A request routed by :meth:`route` finished (or, ``expired``, its owner did
        not end it in time): release what it held and record its outcome (False when it is not
        in flight, e.g. finished already). A ``ttft`` the gateway reports teaches the node's
        prefill rate and, with the output tokens, its time per token."""
        f = self.flights.pop(rid)
        if f is None:
            return False
        now = time.time()
        p, node = f.parsed, f.node
        if not expired:
            self.director.observe(node, "5xx" if status == "error" else None, status == "cancelled")
        await self.gate.release(rid, now)
        if ttft is not None:
            self.ledger.first_token(rid, f.started + ttft, learn=p.stream)
        done = output_tokens // p.sequences if status == "ok" else None
        self.ledger.finish(rid, now, done)
        self.queue.wake()  # a place is free: held requests may go
        if self.sessions is not None and not expired:  # a session's turn: it pauses
            self.sessions.ended(p, f.tenant.name, node, status == "ok", output_tokens, now)
        usage: dict[str, Any] = {"completion_tokens": output_tokens}
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        relay = Served(
            status=status,
            http_status=200 if status == "ok" else 502,
            ttft_s=ttft,
            output_tokens=output_tokens,
            usage=usage,
            error="its owner did not release it before its lease ran out" if expired else None,
        )
        await self.gate.rates.used(f.tenant, rid, p.prompt_tokens_total + output_tokens)
        if status == "ok":
            self.gate.observe_output(f.tenant, p.model, output_tokens // p.sequences)
            if prompt_tokens is not None and not p.exact_tokens:
                self.calibration.observe(p.model, p.prompt_tokens_total, prompt_tokens)
            if f.first_token_s is None:
                self.views.prefilled(node, f.hashes, p.exact_tokens)
        await self.recorder.outcome(rid, node, relay, p, f.started, slo=f.slo)
        return True
