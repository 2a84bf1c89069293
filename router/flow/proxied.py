"""Requests this router proxies itself (owner ``router``): their flight from admission to the
last byte. The proxy (router/http/openai.py) begins one, says where it went, reports its first
token, and ends it with what serving produced; the bookkeeping — in-flight ledger, the router's
queue, learned output lengths and token calibration, the outcome record, the reservation —
lives here, next to the gateway's and the endpoint picker's (router/flow/external.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from admission.gate import AdmissionGate
from router.decision.calibrate import TokenCalibration
from router.decision.inflight import InflightLedger
from router.flow.entry import Taken
from router.flow.flight import ROUTER, Flight, Flights
from router.flow.recorder import Recorder
from router.flow.served import Served
from router.flow.sessions import SessionKeeper
from router.flow.views import ClusterView
from router.flow.waiting import RouterQueue
from router.metrics import RouterMetrics
from router.settings import RouterSettings

__all__ = ["ProxiedRequests"]


class ProxiedRequests:
    def __init__(
        self,
        settings: RouterSettings,
        gate: AdmissionGate,
        flights: Flights,
        ledger: InflightLedger,
        views: ClusterView,
        queue: RouterQueue[Any],
        calibration: TokenCalibration,
        recorder: Recorder,
        metrics: RouterMetrics,
        sessions: SessionKeeper | None = None,
    ) -> None:
        self.settings = settings
        self.gate = gate
        self.flights = flights
        self.ledger = ledger
        self.views = views
        self.queue = queue
        self.calibration = calibration
        self.recorder = recorder
        self.metrics = metrics
        self.sessions = sessions

    def begin(self, t: Taken) -> Flight:
        """The request is admitted (or refused by admission: routing records it) and owned by
        this router, which renews its reservation until :meth:`close`."""
        g = t.gated
        f = Flight(
            t.request_id,
            "",
            ROUTER,
            t.parsed,
            [],
            g.tenant,
            t.started,
            g.slo,
            t.started + self.settings.max_stream_s,
            t.admitted,
        )
        self.flights.add(f)
        return f

    def sent(self, f: Flight, node: str, hashes: Sequence[int] | None = None) -> None:
        """It goes to ``node`` (again, after a re-route)."""
        f.node = node
        if hashes is not None:
            f.hashes = hashes

    def first_token(self, f: Flight, node: str) -> None:
        """Its first token came back from ``node``: the prefill is done (the node holds the
        prompt from now on). A non-streamed answer's "first token" is its end: no sample of
        the node's prefill rate."""
        now = time.time()
        f.first_token_s = now
        self.ledger.first_token(f.id, now, learn=f.parsed.stream)
        self.views.prefilled(node, f.hashes, f.parsed.exact_tokens)

    async def served(self, f: Flight, served: Served, reroutes: int, resumes: int = 0) -> None:
        """Serving ended (answered, failed or cut off): the node's place frees, the router's
        queue may move, what the answer taught is learned and the outcome recorded."""
        p = f.parsed
        done = served.output_tokens // p.sequences if served.status == "ok" else None
        now = time.time()
        self.ledger.finish(f.id, now, done)
        self.queue.wake()  # a place is free: held requests may go
        if self.sessions is not None:  # a session's turn: it pauses, its prefix held
            self.sessions.ended(
                p, f.tenant.name, f.node, served.status == "ok", served.output_tokens, now
            )
        if served.cut_off:
            self.metrics.stalled_clients.inc()
        await self.gate.rates.used(f.tenant, f.id, p.prompt_tokens_total + served.output_tokens)
        if served.status == "ok":
            self.gate.observe_output(f.tenant, p.model, served.output_tokens // p.sequences)
            engine_prompt = (served.usage or {}).get("prompt_tokens")
            if not p.exact_tokens and isinstance(engine_prompt, int):
                self.calibration.observe(p.model, p.prompt_tokens_total, engine_prompt)
        await self.recorder.outcome(f.id, f.node, served, p, f.started, reroutes, f.slo, resumes)

    async def close(self, f: Flight) -> None:
        """The request is over for this router: its reservation goes back."""
        self.flights.pop(f.id)
        if f.admitted:
            await self.gate.release(f.id, time.time())
