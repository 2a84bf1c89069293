"""The router's HTTP service: an OpenAI-compatible proxy that routes each request.

Per request: validate → tokenize and chain-hash → snapshot the replicas → policy decides →
publish the decision → forward to the engine and stream the answer back unbuffered → publish the
outcome. Kafka publishing never waits on the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from pydantic import ValidationError

from admission.exceptions import AdmissionError
from admission.gate import AdmissionGate
from admission.queue import ORDER as PRIORITIES
from admission.reconciler import Reconciler
from admission.reservations import ReservationStore
from admission.settings import AdmissionSettings, Tenant
from admission.storm import StormStore
from router.control import ControlFollower
from router.decision.calibrate import TokenCalibration
from router.decision.candidates import budget_totals
from router.decision.disagg import decode_body, prefill_body, valid_transfer_params
from router.decision.fit import (
    node_admissible_blocks,
    node_capacity_blocks,
)
from router.decision.fleet import Fleet
from router.decision.hotprefix import HotPrefixes
from router.decision.inflight import InflightLedger
from router.decision.lanes import Lanes
from router.decision.outlier import Failure
from router.decision.pipeline import (
    Refused,
    Routed,
    Rules,
    Snapshot,
)
from router.decision.policies import LeastRequestsPolicy
from router.decision.policies.canary import WeightsCanary
from router.decision.types import NodeView, Policy, RouteRequest, eligible
from router.feed import FeedWatch
from router.flow.director import Director, Gated
from router.flow.external import ExternalRequests
from router.flow.flight import ROUTER, Flight, Flights
from router.flow.headers import (
    bearer_key,
    match_key,
    mint_id,
    trace_headers,
)
from router.flow.intake import IntakeReader
from router.flow.recorder import Recorder
from router.flow.refusals import Refusal
from router.flow.served import Served
from router.flow.views import ClusterView
from router.flow.waiting import RouterQueue
from router.http.edge import error_middleware, json_response, path_guard, read_body
from router.http.gateway import GatewayApi
from router.http.passthrough import (
    NOT_ADMITTED,
    PASSTHROUGH_PATHS,
    pick_node,
    relay,
    request_model,
)
from router.http.proxy import forward
from router.metrics import RouterMetrics
from router.parse import ParsedRequest
from router.settings import RouterSettings
from router.tokencheck import TokenCheck, engine_tokens, first_difference
from router.tracing import Tracing
from streams.kafka import KafkaBus
from streams.replica import TableReplica
from streams.schemas import Heartbeat
from streams.topics import LEDGER

__all__ = ["RouterService"]

log = logging.getLogger(__name__)


def _reroutable(resp: web.StreamResponse, relay: Served) -> bool:
    """A failure the client has not seen yet, of a kind another node may not have: the engine
    had no room for the request's KV (vLLM-style 400 naming the KV cache), was overloaded (503)
    or unreachable (502)."""
    if relay.status == "ok" or resp.prepared:
        return False
    if relay.http_status in (502, 503):
        return True
    return relay.http_status == 400 and "kv cache" in (relay.error or "").lower()


_PREFILL_ANSWER_BYTES = 1 << 20  # a prefill engine's one-token answer, with its transfer params


async def _read_bounded(up: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """An answer's body, or None when it is larger than ``limit``."""
    data = bytearray()
    async for chunk in up.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)


# what agents report of their engine's KV events, per node in /v1/kvgate/state
_COUNTERS = (
    "engine_restarts",
    "kv_events_lost",
    "kv_events_undecodable",
    "kv_blocks_untranslatable",
    "kv_blocks_skipped",
)


def _agent_counters(hb: Heartbeat | None) -> dict[str, int]:
    return {name: getattr(hb, name) if hb is not None else 0 for name in _COUNTERS}


class RouterService:
    def __init__(
        self,
        settings: RouterSettings,
        replica: TableReplica,
        bus: KafkaBus,
        policy: Policy,
        admission: AdmissionSettings | None = None,
        store: ReservationStore | None = None,
        storm_store: StormStore | None = None,
    ) -> None:
        self.settings = settings
        self.replica = replica
        self.bus = bus
        # the policy, and the candidate weights of a canary (kvgate weights --canary)
        self.policy = WeightsCanary(policy, settings)
        self.router_id = (
            settings.router_id or f"{socket.gethostname()}:{settings.port}:{os.getpid()}"
        )
        self.ledger = InflightLedger(track_blocks=getattr(policy, "wants_active_blocks", False))
        if getattr(policy, "wants_sequences", False):  # a peer that counts its own requests
            policy.sequences = self.ledger  # type: ignore[attr-defined]
        self.lanes = Lanes(settings.lanes, settings.cost.prefill_tokens_per_s)
        self.queue: RouterQueue[tuple[Routed | Refused, Snapshot]] = RouterQueue(
            settings.hold_poll_s, settings.lanes.max_waiting
        )
        self.fleet = Fleet(settings.outlier, settings.slow_start)
        self.gate = AdmissionGate(
            admission or AdmissionSettings(),
            self.router_id,
            lambda ev: bus.publish(LEDGER, ev.pool, ev),
            store,
            storm_store,
        )
        self.metrics = RouterMetrics()
        self.tracing = Tracing(settings.otlp_endpoint, f"kvgate-router/{self.router_id}")
        self._http: aiohttp.ClientSession | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._pumper: asyncio.Task[None] | None = None
        self.control: ControlFollower | None = None
        self.reconciler: Reconciler | None = None
        key = settings.upstream_api_key
        # engines started with --api-key (vLLM) want it on every /v1 call
        self._upstream_auth = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        # the requests this router routed, each with its owner (router/flow/flight.py)
        self.flights = Flights()
        self._loops_failing: dict[str, str] = {}
        self.calibration = TokenCalibration()
        self.tokencheck = TokenCheck(
            settings.tokenize_check_every,
            settings.tokenize_check_min,
            settings.tokenize_mismatch_share,
        )
        self._checks: set[asyncio.Task[None]] = set()
        self._started_at = time.time()
        self.feed = FeedWatch(settings, replica)
        self._prober: asyncio.Task[None] | None = None
        self._build_flow(settings, bus)

    def _build_flow(self, settings: RouterSettings, bus: KafkaBus) -> None:
        """The request flow (router/flow/): views, recorder, intake, the pipeline's rules and
        the director, the requests gateways carry, the gateway API."""
        self.views = ClusterView(settings, self.replica, self.fleet, self.feed, self.ledger)
        self.recorder = Recorder(
            settings, bus, self.router_id, self.policy, self.views, self.metrics
        )
        self.reader = IntakeReader(
            settings, self.gate, self.views, self.tokencheck, self.metrics, self.recorder
        )
        rules = Rules(
            self.policy,
            self.fleet,
            self.gate.settings,
            self.lanes,
            HotPrefixes() if settings.prewarm else None,
            fallback=LeastRequestsPolicy(),
            disaggregation=settings.disaggregation,
            kv_bytes_per_token=settings.kv_bytes_per_token,
            kv_link_gbps=settings.kv_link_gbps,
        )
        self.director = Director(
            settings,
            self.gate,
            self.views,
            rules,
            self.ledger,
            self.queue,
            self.metrics,
            self.recorder,
            self.reader,
            self.calibration,
        )
        self.external = ExternalRequests(
            settings,
            self.gate,
            self.director,
            self.flights,
            self.ledger,
            self.views,
            self.recorder,
            self.queue,
            self.calibration,
            self._check_tokens,
        )
        self.gateway = GatewayApi(
            settings, self.metrics, self.intake, self.external, self.gate, self.flights
        )

    def app(self) -> web.Application:
        """The main listener: the OpenAI API for tenants, the gateway API for gateways (their
        own key), the admin endpoints for admin keys, probes and metrics for anyone."""
        app = web.Application(
            client_max_size=self.settings.max_body_bytes,
            middlewares=[error_middleware, path_guard],
        )
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/kvgate/decide", self._admin_only(self._decide))
        app.router.add_post("/v1/kvgate/route", self.gateway.route)
        app.router.add_post("/v1/kvgate/release", self.gateway.release)
        app.router.add_post("/v1/kvgate/renew", self.gateway.renew)
        app.router.add_get("/v1/kvgate/state", self._admin_only(self._state))
        app.router.add_get("/v1/models", self._models)
        # the engines' non-generating API (embeddings, score, rerank…): passed through by
        # model; nothing else under /v1 reaches an engine (router/http/passthrough.py)
        for path in PASSTHROUGH_PATHS:
            app.router.add_post(path, self._passthrough)
        app.router.add_post("/v1/{tail:.+}", self._not_served)
        self._add_probes(app)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def admin_app(self) -> web.Application:
        """The admin listener (``router.admin_port``, loopback by default): the admin
        endpoints without credentials, probes and metrics. Its lifecycle is the main app's."""
        app = web.Application(client_max_size=1 << 20, middlewares=[error_middleware, path_guard])
        app.router.add_post("/v1/kvgate/decide", self._decide)
        app.router.add_get("/v1/kvgate/state", self._state)
        self._add_probes(app)
        return app

    def _add_probes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)

    def _admin_only(
        self, handler: Callable[[web.Request], Awaitable[web.Response]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        """``handler`` for callers with an admin key (``Authorization: Bearer <admin key>``)."""

        async def guarded(request: web.Request) -> web.Response:
            if match_key(self.settings.admin_keys, bearer_key(request.headers)) is None:
                self.metrics.rejected("admin_unauthorized")
                where = (
                    f" or use the admin listener on {self.settings.admin_host}"
                    if self.settings.admin_port is not None
                    else ""
                )
                raise Refusal(401, f"an admin key is required{where}", "unauthorized")
            return await handler(request)

        return guarded

    def _tenant(self, request: web.Request) -> Tenant:
        """The calling tenant, from its API key, before anything of the body is read."""
        return self.reader.tenant(request.headers)

    async def _start(self, _: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.settings.upstream_connect_timeout_s,
            sock_read=self.settings.upstream_idle_timeout_s,
        )
        self._http = aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
        )
        self._sweeper = asyncio.create_task(self._sweep_reservations())
        self._pumper = asyncio.create_task(self.gate.run_pump(time.time))
        self._prober = asyncio.create_task(self._probe_while_degraded())

    async def _probe_while_degraded(self) -> None:
        """Without a live feed, the router asks the last-known engines itself (``GET
        /health``): a node that does not answer leaves the candidate set until it does."""
        while True:
            await asyncio.sleep(self.settings.probe_interval_s)
            try:
                if self._http is not None:
                    await self.feed.probe(self._http, time.time())
                self._loops_failing.pop("prober", None)
            except Exception as exc:  # the loop goes on; /ready says so meanwhile
                self._loops_failing["prober"] = f"{type(exc).__name__}: {exc}"[:300]
                log.exception("engine probes failed")

    async def _sweep_reservations(self) -> None:
        """The requests this router is serving keep their leases (renewed as they run out);
        leases that ran out (a release lost to a crash path) expire with an event."""
        while True:
            await asyncio.sleep(self.gate.settings.sweep_interval_s)
            now = time.time()
            try:
                for f in self.flights.expired(now):  # their owner did not end them in time
                    await self.external.finish(f.id, "cancelled", 0, None, None, None, expired=True)
                # this router's and its EPP's requests; a gateway renews its own
                # (/v1/kvgate/renew); a reservation no flight owns expires with its lease
                serving = [rid for rid in self.gate.held if self.flights.renews(rid)]
                await self.gate.renew(serving, now)
                await self.gate.sweep(now)
                self._loops_failing.pop("sweeper", None)
            except AdmissionError as exc:
                log.warning("reservation sweep failed: %s", exc)
            except Exception as exc:  # the loop goes on; /ready says so meanwhile
                self._loops_failing["sweeper"] = f"{type(exc).__name__}: {exc}"[:300]
                log.exception("reservation sweep failed")

    def failing_loops(self) -> dict[str, str]:
        """Background loops that are down (restarting with backoff), and why."""
        out = dict(self._loops_failing)
        parts: list[tuple[str, Any]] = [("replica", self.replica), ("control", self.control)]
        if self.reconciler is not None:
            parts += [("reconciler", self.reconciler), ("ledger", self.reconciler.ledger)]
        for name, part in parts:
            why = getattr(part, "failing", None)
            if why:
                out[name] = why
        if self._pumper is not None and self._pumper.done():
            out["queue_pump"] = "stopped"
        others = self.other_inproc_routers()
        if others:
            out["admission"] = (
                f"routers {sorted(others)[:5]} write the same ledger with in-process "
                "reservation stores: each admits against the whole budget (set "
                "admission.backend=redis)"
            )
        return out

    def other_inproc_routers(self) -> list[str]:
        """Other routers writing reservations to this ledger since this router started, while
        this one keeps its reservations in process (sole owner of the budget): together they
        would over-admit N-fold."""
        rec = self.reconciler
        if rec is None or not rec.sole_owner or not self.gate.settings.enabled:
            return []
        return [
            r
            for r, ts in rec.ledger.writers.items()
            if r != self.router_id and ts >= self._started_at
        ]

    async def _stop(self, _: web.Application) -> None:
        for task in (self._sweeper, self._pumper, self._prober, *self._checks):
            if task is not None:
                task.cancel()
        await self.queue.stop()
        if self._http is not None:
            await self._http.close()
        # the last spans leave before the process does (bounded by the exporter's timeout)
        await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)

    # --- snapshot ------------------------------------------------------------------------
    # --- endpoints -----------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    def _check_tokens(self, node: NodeView, p: ParsedRequest) -> None:
        """Now and then, the engine tokenizes the same request: do the token ids agree?"""
        if not p.exact_tokens or p.model not in self.reader.tokenizations or p.other_prompt_tokens:
            return  # (a batch: the engine's /tokenize takes one prompt)
        if not self.tokencheck.due(p.model):
            return
        task = asyncio.create_task(self._compare_tokens(node, p))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _compare_tokens(self, node: NodeView, p: ParsedRequest) -> None:
        if self._http is None:
            return
        theirs = await engine_tokens(self._http, node.endpoint, p, headers=self._upstream_auth)
        if theirs is None:
            return  # the engine has no /tokenize (or refused): nothing learned
        matched = theirs == p.tokens
        self.metrics.token_checks.labels(p.model).inc()
        if not matched:
            self.metrics.token_mismatches.labels(p.model).inc()
            log.warning(
                "tokenization of %s differs from %s's from token %d (%d vs %d tokens)",
                p.model[:100],
                node.node_id,
                first_difference(theirs, p.tokens),
                len(p.tokens),
                len(theirs),
            )
        if self.tokencheck.record(p.model, matched):
            log.error(
                "tokenization of %s marked approximate: the configured tokenizer or chat "
                "template is not the engine's",
                p.model[:100],
            )

    async def _intake(
        self, request: web.Request, chat: bool | None
    ) -> tuple[str, float, ParsedRequest, Gated, float]:
        """Check the headers, authenticate, then read, parse (``chat`` None: chat when the body
        has ``messages``) and gate a request: a refusal, or (request id, start time, request,
        gate result, decision clock start). The request id is minted here; nothing a client
        chose names state. Refusals before admission are recorded as decisions too."""
        return await self.intake(
            request.headers,
            lambda: read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s),
            chat,
            request.remote,
        )

    async def intake(
        self,
        headers: Mapping[str, str],
        read: Callable[[], Awaitable[bytes]],
        chat: bool | None,
        peer: str | None = None,
    ) -> tuple[str, float, ParsedRequest, Gated, float]:
        """:meth:`_intake` of a request known by its headers and a reader of its body (what an
        Envoy external processor gets); ``peer``: the client's address, when known."""
        started = time.time()
        i = await self.reader.read(headers, read, chat, peer, started)
        t0 = time.perf_counter()
        try:
            g = await self.director.admit(i)
        except Refusal as exc:
            self.recorder.refusal(
                i.request_id, started, exc.reason, i.tenant.name, i.parsed, i.client_request_id
            )
            raise
        return i.request_id, started, i.parsed, g, t0

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        with self.tracing.span("kvgate.request", {"http.route": request.path}, request.headers):
            return await self._handle_traced(request, chat)

    async def _handle_traced(self, request: web.Request, chat: bool) -> web.StreamResponse:
        with self.tracing.span("kvgate.admission") as span:
            taken = await self._intake(request, chat)
            if span is not None:
                g = taken[3]
                span.set_attribute("kvgate.admitted", bool(g.verdict and g.verdict.admitted))
                span.set_attribute("kvgate.tenant", g.tenant.name)
        request_id, started, p, g, t0 = taken
        admitted = g.verdict is not None and g.verdict.admitted
        until = started + self.settings.max_stream_s
        self.flights.add(
            Flight(request_id, "", ROUTER, p, [], g.tenant, started, g.slo, until, admitted)
        )
        try:
            return await self._admitted(request, request_id, p, g, started, t0)
        finally:
            self.flights.pop(request_id)
            if g.verdict is not None and g.verdict.admitted:
                await self.gate.release(request_id, time.time())

    async def _admitted(
        self,
        request: web.Request,
        request_id: str,
        p: ParsedRequest,
        g: Gated,
        started: float,
        t0: float,
    ) -> web.StreamResponse:
        tenant = g.tenant
        with self.tracing.span("kvgate.route", {"kvgate.request_id": request_id}) as span:
            routed = await self.director.route(request_id, p, g, started, t0)
            if span is not None:
                span.set_attribute("kvgate.node", routed[2].node_id)
                span.set_attribute("kvgate.reason", routed[1].reason)
                span.set_attribute("kvgate.prompt_blocks", len(routed[0].request.block_hashes))
        ask, decision, node = routed
        rreq = ask.request
        self._check_tokens(node, p)
        flight = self.flights.get(request_id)
        if flight is not None:
            flight.node, flight.hashes = node.node_id, rreq.block_hashes
        assert self._http is not None
        sent = p
        if decision.prefill is not None:  # disaggregated: the prompt's KV comes from P
            sent = await self._prefill_leg(request_id, p, g, decision.prefill, rreq)
        relay = Served()
        reroutes = 0
        try:
            while True:
                target = node
                with self.tracing.span(
                    "kvgate.proxy", {"kvgate.node": target.node_id, "kvgate.model": p.model}
                ) as span:
                    resp, relay = await forward(
                        self._http,
                        request,
                        request_id,
                        target,
                        sent if target is node and not reroutes else p,
                        started,
                        on_first_token=functools.partial(
                            self._first_token, request_id, target.node_id, rreq, p.stream
                        ),
                        write_timeout_s=self.settings.stream_write_timeout_s,
                        send_buffer_bytes=self.settings.stream_send_buffer_bytes,
                        max_duration_s=max(
                            0.0, self.settings.max_stream_s - (time.time() - started)
                        ),
                        # with tracing on the engine continues this span, not the client's
                        upstream_headers={**self._upstream_auth, **self.tracing.inject()},
                    )
                    if span is not None:
                        span.set_attribute("http.response.status_code", relay.http_status)
                        span.set_attribute("kvgate.output_tokens", relay.output_tokens)
                self.director.observe(target.node_id, relay.failure, relay.status == "cancelled")
                if self.feed.state != "live" and relay.http_status == 502 and not resp.prepared:
                    self.feed.down.add(target.node_id)  # until it answers a probe again
                if reroutes or not _reroutable(resp, relay):
                    return resp
                # the node could not take it (no room for its KV, or gone) before anything
                # reached the client: once, to the best other node; the reservation is for the
                # cluster's budget, so it stays with the request
                again = self.director.reroute(ask, g, node.node_id, p)
                if again is None:
                    return resp
                log.warning(
                    "%s: %s failed before any byte (%s); re-routing to %s",
                    request_id,
                    node.node_id,
                    relay.http_status,
                    again.node_id,
                )
                node = again
                if flight is not None:
                    flight.node = node.node_id
                reroutes += 1
        finally:
            done = relay.output_tokens // p.sequences if relay.status == "ok" else None
            self.ledger.finish(request_id, time.time(), done)
            self.queue.wake()  # a place is free: held requests may go
            if relay.cut_off:
                self.metrics.stalled_clients.inc()
            if relay.status == "ok":
                self.gate.observe_output(tenant, p.model, relay.output_tokens // p.sequences)
                engine_prompt = (relay.usage or {}).get("prompt_tokens")
                if not p.exact_tokens and isinstance(engine_prompt, int):
                    self.calibration.observe(p.model, p.prompt_tokens_total, engine_prompt)
            await self.recorder.outcome(
                request_id, node.node_id, relay, p, started, reroutes, g.slo
            )

    async def _prefill_leg(
        self, request_id: str, p: ParsedRequest, g: Gated, prefill: str, rreq: RouteRequest
    ) -> ParsedRequest:
        """Disaggregated prefill, first leg: ``prefill`` computes the prompt (vLLM's flow:
        one token, not streamed, KV kept for a remote decode), holding a second reservation
        for that KV meanwhile; returns the request for the decode node with P's transfer
        params — or unchanged when the leg fails (the decode node then computes the prompt)."""
        assert self._http is not None
        pnode = next((n for n in g.nodes if n.node_id == prefill), None)
        if pnode is None:
            return p
        key = f"{request_id}/prefill"
        now = time.time()
        extra = (
            g.verdict is not None
            and g.verdict.admitted
            and await self.gate.hold_extra(
                key,
                g.tenant,
                g.budget[0],
                math.ceil(p.prompt_tokens_total / g.block_size),
                g.budget[1],
                now,
            )
        )
        hit = self.views.matches(rreq.block_hashes, now).get(prefill, 0)
        self.ledger.dispatch(key, prefill, now, max(0, rreq.prompt_tokens - hit * g.block_size))
        params = None
        failure: Failure | None = None
        try:
            async with (
                asyncio.timeout(self.settings.prefill_timeout_s),
                self._http.post(
                    pnode.endpoint.rstrip("/") + p.path,
                    data=orjson.dumps(prefill_body(p.body)),
                    headers={
                        "Content-Type": "application/json",
                        "X-Request-Id": request_id,
                        **pnode.engine_headers,
                        **self._upstream_auth,
                    },
                ) as up,
            ):
                data = await _read_bounded(up, _PREFILL_ANSWER_BYTES)
                if up.status >= 500:
                    failure = "5xx"
                elif up.status == 200 and data is not None:
                    params = valid_transfer_params(orjson.loads(data))
        except TimeoutError:
            failure = "timeout"
        except aiohttp.ClientError:
            failure = "connect"
        except ValueError:  # not JSON, or too large: the engine is no KV producer
            pass
        finally:
            self.ledger.finish(key)
            if extra:
                await self.gate.release(key, time.time())
        self.director.observe(prefill, failure)
        if params is None:
            log.warning(
                "%s: prefill on %s gave no KV to transfer; decoding node computes it",
                request_id,
                prefill,
            )
            self.metrics.disaggregated.labels("fallback").inc()
            return p
        self.metrics.disaggregated.labels("ok").inc()
        return replace(p, body=decode_body(p.body, params))

    def _first_token(self, request_id: str, node: str, rreq: RouteRequest, stream: bool) -> None:
        # a non-streamed answer's "first token" is its end: no sample of the prefill rate
        self.ledger.first_token(request_id, time.time(), learn=stream)
        self.views.prefilled(node, rreq.block_hashes)

    # --- decision-only API for gateways ----------------------------------------------------
    async def _decide(self, request: web.Request) -> web.Response:
        """Dry run: what would the router do with this body (completion or chat)? No events,
        no pre-warm advice, no reservation. An admin endpoint: it shows what the index holds."""
        raw = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s)
        try:
            body = orjson.loads(raw)
            p = self.reader.parse(raw, chat=isinstance(body, dict) and "messages" in body)
        except (orjson.JSONDecodeError, ValidationError, ValueError) as exc:
            raise Refusal(400, str(exc).splitlines()[0]) from None
        t0 = time.perf_counter()
        now = time.time()
        rreq, d, nodes, block_size = self.director.dry_run(p, now)
        decision_us = (time.perf_counter() - t0) * 1e6
        endpoint = next((n.endpoint for n in nodes if n.node_id == d.chosen), None)
        return json_response(
            {
                "chosen_node": d.chosen,
                "endpoint": endpoint,
                "reason": d.reason,
                "prompt_tokens": rreq.prompt_tokens,
                "prompt_blocks": len(rreq.block_hashes),
                "block_size": block_size,
                "decision_us": decision_us,
                "policy": self.policy.name,
                "weights_version": self.policy.weights_version,
                "candidates": [
                    {
                        "node_id": c.node_id,
                        "score": c.score,
                        "hit_blocks": c.hit_blocks,
                        "kv_used_ratio": c.kv_used_ratio,
                        "queue_len": c.queue_len,
                    }
                    for c in d.candidates
                ],
            }
        )

    async def _state(self, _: web.Request) -> web.Response:
        """The replica as this router sees it: nodes, their load and indexed blocks."""
        now = time.time()
        views = self.views.nodes(now)
        budgets: dict[str, dict[str, Any]] = {}
        try:
            reservations: int | None = await self.gate.store.count()
            for key, total in budget_totals(views, now).items():
                blocks, slots, _drain = await self.gate.store.snapshot(key, now)
                budgets[key] = {
                    "kv_blocks_total": total,
                    "reserved_kv_blocks": blocks,
                    "reserved_slots": slots,
                    "used_ratio": round(blocks / total, 4) if total else None,
                    "queued": self.gate.queues.depth(key),
                }
            reserved: int | None = sum(b["reserved_kv_blocks"] for b in budgets.values())
        except AdmissionError:
            reservations = reserved = None  # the store is unreachable
        queued: Counter[str] = Counter({p: 0 for p in PRIORITIES})
        for key in self.gate.queues.pools():
            queued.update(self.gate.queues.depth(key))
        beats = self.replica.load
        return json_response(
            {
                "router_id": self.router_id,
                "policy": self.policy.name,
                "weights_version": self.policy.weights_version,
                "weights_canary": self.policy.state(),
                "weights_refused": self.control.refused if self.control else 0,
                **self.fleet.state(now),
                "token_calibration": self.calibration.report(),
                "tokenization_checks": self.tokencheck.report(),
                "replica_caught_up": self.replica.caught_up.is_set(),
                "indexed_blocks": len(self.replica.index),
                "reservations": reservations,
                "reserved_kv_blocks": reserved,
                "budgets": budgets,
                "queued": dict(queued),
                "inflight": len(self.ledger),
                "lanes": {
                    "enabled": self.lanes.s.enabled,
                    "queue": len(self.queue),
                    "long_prefill_share": round(self.lanes.long_share(), 4),
                    "lane": sorted(self.lanes.lane(views)),
                },
                "reconciler": (
                    self.reconciler.report(self.replica.load.values(), now)
                    if self.reconciler is not None
                    else None
                ),
                "nodes": {
                    n.node_id: {
                        "model": n.model,
                        "pool": n.pool,
                        "role": n.role,
                        "labels": dict(sorted(n.labels)),
                        "started_at": n.started_at,
                        "endpoint": n.endpoint,
                        "alive": n.alive(now),
                        "healthy": n.healthy,
                        "running": n.running,
                        "waiting": n.waiting,
                        "pending": n.pending,
                        "remaining_decode_tokens": n.decode_backlog_tokens,
                        "prefill_backlog_tokens": n.prefill_backlog_tokens,
                        # the rate its prompts are costed at (its model's mean), its own
                        "prefill_tokens_per_s": round(n.prefill_tokens_per_s, 1) or None,
                        "observed_prefill_tokens_per_s": round(
                            self.ledger.node_prefill_rate(n.node_id), 1
                        )
                        or None,
                        "long_kv_blocks": n.long_kv_blocks,
                        "kv_used_ratio": n.kv_used_ratio,
                        "heartbeat_age_s": now - n.heartbeat_ts,
                        "indexed_blocks": len(self.replica.index.blocks_view(n.node_id)),
                        "kv_index": beats[n.node_id].kv_index if n.node_id in beats else None,
                        **_agent_counters(beats.get(n.node_id)),
                    }
                    for n in views
                },
            }
        )

    async def _not_served(self, request: web.Request) -> web.StreamResponse:
        """A ``POST /v1/…`` kvgate neither serves nor passes through: engine admin endpoints
        (``/v1/load_lora_adapter``…), generating endpoints it does not admit, unknown paths."""
        path = request.path[:200]
        if path in NOT_ADMITTED:
            msg = (
                f"{path} is not served through kvgate: use /v1/chat/completions or /v1/completions"
            )
            raise Refusal(404, msg, "NotFoundError", reason="not_served")
        raise Refusal(404, f"no such endpoint: {path}", "NotFoundError", reason="not_served")

    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        """``POST`` of an allow-listed non-generating endpoint, to a node serving its model."""
        self._tenant(request)
        raw = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s)
        model = request_model(raw)
        now = time.time()
        all_nodes = self.views.nodes(now)
        if not any(n.serves(model) for n in all_nodes):
            raise Refusal(404, f"The model `{model[:200]}` does not exist.", "NotFoundError")
        nodes = [n for n in eligible(all_nodes, model, now) if n.waiting <= self.settings.max_queue]
        if not nodes:
            raise Refusal(503, f"no healthy node serves `{model[:200]}` now", "service_unavailable")
        node = pick_node(nodes)
        headers = {
            "X-Request-Id": mint_id(),
            **trace_headers(request.headers),
            **node.engine_headers,
            **self._upstream_auth,
        }
        if self._http is None:  # not started yet
            raise Refusal(503, "the router is starting", "service_unavailable")
        return await relay(self._http, request, node, raw, headers)

    # --- introspection -------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        self._tenant(request)  # what a cluster serves is for its tenants
        now = time.time()
        live = [n for n in self.views.nodes(now) if n.alive(now)]
        bases = {n.model for n in live}
        adapters = {a: n.model for n in live for a in n.adapters if a not in bases}
        entry = {"object": "model", "owned_by": "kvgate"}
        return json_response(
            {
                "object": "list",
                "data": [{**entry, "id": m, "root": m, "parent": None} for m in sorted(bases)]
                + [{**entry, "id": a, "root": a, "parent": adapters[a]} for a in sorted(adapters)],
            }
        )

    async def _health(self, _: web.Request) -> web.Response:
        return json_response({"status": "ok", "router_id": self.router_id})

    def is_ready(self, now: float) -> bool:
        """Tables caught up, a healthy node, no background loop failing (the admission store
        is checked by ``/ready``)."""
        healthy = any(n.healthy and n.alive(now) for n in self.views.nodes(now))
        return self.replica.caught_up.is_set() and healthy and not self.failing_loops()

    @property
    def upstream_auth(self) -> dict[str, str]:
        """Headers engines started with an API key want (empty without one)."""
        return dict(self._upstream_auth)

    async def _ready(self, _: web.Request) -> web.Response:
        now = time.time()
        healthy = [n.node_id for n in self.views.nodes(now) if n.healthy and n.alive(now)]
        store_ready = True
        if self.gate.settings.enabled:
            try:  # an empty Redis admits nothing until the reconciler rebuilt it
                store_ready = await self.gate.store.generation() is not None
            except AdmissionError:
                store_ready = False
        failing = self.failing_loops()
        ready = self.replica.caught_up.is_set() and bool(healthy) and store_ready and not failing
        return json_response(
            {
                "ready": ready,
                "failing": failing,
                # degraded routers stay ready: they serve on what they know (router/feed.py)
                "feed": self.feed.state,
                "kafka_queued": self.bus.queued,
                "replica_caught_up": self.replica.caught_up.is_set(),
                "admission_store_ready": store_ready,
                "healthy_nodes": len(healthy),
                "indexed_blocks": len(self.replica.index),
            },
            200 if ready else 503,
        )

    async def _metrics(self, _: web.Request) -> web.Response:
        now = time.time()
        beats = list(self.replica.load.values())
        m = self.metrics
        m.replica_lag.set(now - max((hb.ts for hb in beats), default=now))
        views = self.views.nodes(now)
        m.index_gap.set(sum(v.kv_index_gap for v in views))
        m.engine_restarts.set(sum(hb.engine_restarts for hb in beats))
        m.kv_events_lost.set(sum(hb.kv_events_lost for hb in beats))
        for name in _COUNTERS[2:]:
            m.kv_agent.labels(name).set(sum(getattr(hb, name) for hb in beats))
        for kind in ("events", "approximate", "degraded"):
            m.nodes_kv_index.labels(kind).set(sum(1 for hb in beats if hb.kv_index == kind))
        healthy = sum(1 for v in views if v.healthy and v.alive(now))
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
        fleet = self.fleet.counts(views, now)
        for state, n in fleet.items():
            m.fleet_nodes.labels(state).set(n)
        m.nodes.labels("healthy").set(healthy)
        m.nodes.labels("unhealthy").set(len(views) - healthy)
        with contextlib.suppress(AdmissionError):
            m.reservations.set(await self.gate.store.count())
        m.kafka_queued.set(self.bus.queued)
        batch = getattr(self.gate.store, "batch", None)  # the Redis store's (admission.redis_batch)
        if batch is not None:
            m.redis_scripts.labels("calls").set(batch.calls)
            m.redis_scripts.labels("round_trips").set(batch.round_trips)
        for topic, n in self.bus.dropped.items():
            m.kafka_dropped.labels(topic).set(n)
        for mode in ("last_known", "load_only"):
            m.degraded.labels(mode).set(1 if self.feed.state == mode else 0)
        inflight = self.flights.by_priority()
        depth: Counter[str] = Counter()
        for pool in self.gate.queues.pools():
            depth.update(self.gate.queues.depth(pool))
        for priority in PRIORITIES:
            m.inflight.labels(priority).set(inflight[priority])
            m.queue_depth.labels(priority).set(depth[priority])
        if self.gate.settings.enabled:
            for key, total in sorted(budget_totals(views, now).items()):
                with contextlib.suppress(AdmissionError):
                    held = (await self.gate.store.snapshot(key, now))[0]
                    m.budget_used.labels(key).set(held / total if total else 0.0)
        return web.Response(body=m.render(), content_type="text/plain", charset="utf-8")
