"""The OpenAI API for tenants: ``/v1/completions`` and ``/v1/chat/completions``, and the agent
APIs ``/v1/messages`` (Anthropic's) and ``/v1/responses`` (proxied: in, routed in the
pipeline's ``proxy`` mode, forwarded, streamed back), ``/v1/models``, the
allow-listed non-generating endpoints passed through by model, and a clear 404 for every other
``/v1`` path. The handlers translate; the flow layer decides (router/flow/)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from router.decision.types import NodeView
from router.feed import FeedWatch
from router.flow.director import Ask, Director
from router.flow.entry import Entry, Taken
from router.flow.flight import Flight
from router.flow.headers import client_label, mint_id, trace_headers
from router.flow.intake import Head, IntakeReader
from router.flow.passadmit import PassthroughGate
from router.flow.proxied import ProxiedRequests
from router.flow.refusals import Refusal
from router.flow.served import Served
from router.flow.views import ClusterView
from router.http.edge import json_answer
from router.http.passthrough import (
    PASSTHROUGH,
    model_list,
    passthrough_node,
    relay,
    request_model,
)
from router.http.preemptible import preemptible
from router.http.prefill import PrefillLeg
from router.http.probes import TokenChecks
from router.http.proxy import StallBudget, Whole, end_stream, forward
from router.http.resume import Splice, Trail, continuation
from router.http.upstream import Upstream
from router.parse import ParsedRequest
from router.settings import RouterSettings
from router.tracing import Tracing
from router.wire.client import Answer
from router.wire.server import Headers, Reply, Request
from streams.agentapis import Api

__all__ = ["OpenAiApi", "reroutable"]

log = logging.getLogger(__name__)


MAX_REROUTES = 3  # other nodes tried after the first failed a request before any byte


def reroutable(reply: Reply, served: Served) -> bool:
    """A failure the client has not seen yet, of a kind another node may not have: the engine
    had no room for the request's KV (vLLM-style 400 naming the KV cache), was overloaded (503)
    or unreachable (502)."""
    if served.status in ("ok", "preempted") or reply.started:
        return False
    if served.http_status in (502, 503):
        return True
    return served.http_status == 400 and "kv cache" in (served.error or "").lower()


def _cuttable(f: Flight, trail: Trail) -> Callable[[Answer | None], None]:
    """While ``f``'s engine streams, a drain may end that stream when it can go on elsewhere
    (router/loops.py: the drain sweep)."""

    def streaming(up: Answer | None) -> None:
        def cut(why: str) -> None:
            if up is not None and trail.resumable:
                up.cut(why)

        f.cut = None if up is None else cut

    return streaming


class OpenAiApi:
    def __init__(
        self,
        settings: RouterSettings,
        entry: Entry,
        director: Director,
        proxied: ProxiedRequests,
        upstream: Upstream,
        prefill: PrefillLeg,
        tokens: TokenChecks,
        tracing: Tracing,
        feed: FeedWatch,
    ) -> None:
        self.settings = settings
        self.entry = entry
        self.director = director
        self.proxied = proxied
        self.upstream = upstream
        self.prefill = prefill
        self.tokens = tokens
        self.tracing = tracing
        self.feed = feed
        self.reader: IntakeReader = entry.reader
        self.views: ClusterView = director.views
        self.passing = PassthroughGate(
            director.gate, director.views, director.metrics, entry.recorder, settings.block_size
        )

    def screen(self, headers: Headers, _: str) -> Head:
        """A completion's headers, checked before its body is read."""
        return self.reader.head(headers, time.time())

    def screen_tenant(self, headers: Headers, _: str) -> None:
        """What a cluster serves is for its tenants."""
        self.reader.tenant(headers)

    async def completions(self, request: Request, reply: Reply) -> None:
        await self._handle(request, reply, chat=False)

    async def chat(self, request: Request, reply: Reply) -> None:
        await self._handle(request, reply, chat=True)

    async def messages(self, request: Request, reply: Reply) -> None:
        """Anthropic's Messages API, routed as the chat the engine makes of it."""
        await self._handle(request, reply, chat=True, api="messages")

    async def responses(self, request: Request, reply: Reply) -> None:
        """OpenAI's Responses API, routed as the chat the engine makes of it."""
        await self._handle(request, reply, chat=True, api="responses")

    async def _handle(
        self, request: Request, reply: Reply, chat: bool, api: Api | None = None
    ) -> None:
        head: Head = request.screened[1]
        with self.tracing.span("kvgate.request", {"http.route": request.path}, request.headers):
            with self.tracing.span("kvgate.admission") as span:
                t = await self.entry.take(
                    request.headers, request.read, chat, request.peer, head, api
                )
                if span is not None:
                    span.set_attribute("kvgate.admitted", t.admitted)
                    span.set_attribute("kvgate.tenant", t.gated.tenant.name)
            f = self.proxied.begin(t)
            try:
                await self._serve(request, reply, t, f)
            finally:
                await self.proxied.close(f)

    async def _serve(self, request: Request, reply: Reply, t: Taken, f: Flight) -> None:
        """Route, run the prefill leg of a split request, forward; once more elsewhere when the
        node failed it before the client saw anything."""
        p, g = t.parsed, t.gated
        with self.tracing.span("kvgate.route", {"kvgate.request_id": t.request_id}) as span:
            ask, decision, node = await self.director.route(t.request_id, p, g, t.started, t.t0)
            if span is not None:
                span.set_attribute("kvgate.node", node.node_id)
                span.set_attribute("kvgate.reason", decision.reason)
                span.set_attribute("kvgate.prompt_blocks", len(ask.request.block_hashes))
        self.tokens.check(node, p)
        self.proxied.sent(f, node.node_id, ask.request.block_hashes)
        sent = p
        if decision.prefill is not None:  # disaggregated: the prompt's KV comes from P
            sent = await self.prefill.run(t.request_id, p, g, decision.prefill, ask.request)
        elif decision.pull is not None:  # the prefix's KV comes from its holder
            sent = await self.prefill.pull(t.request_id, p, g, decision.pull, decision.pull_blocks)
        served = Served()
        failed: list[str] = []
        reroutes = resumes = 0
        trail = Trail(p) if p.stream and self.settings.stream_resumes else None
        try:
            while True:
                served, whole = await self._forward(request, reply, t, f, node, sent, trail)
                if served.broken and trail is not None:
                    served, resumes = await self._resume(request, reply, t, f, ask, node, trail)
                    return
                if reroutes >= MAX_REROUTES or not reroutable(reply, served):
                    if whole is not None:
                        whole.send(reply)
                    return
                # the node could not take it (no room for its KV, or gone) before anything
                # reached the client: to the best node that has not failed it (several nodes
                # die at once: a rack, a zone); the reservation is for the cluster's budget,
                # so it stays with the request
                failed.append(node.node_id)
                again = self.director.reroute(ask, g, failed, p)
                if again is None:
                    if whole is not None:
                        whole.send(reply)
                    return
                log.warning(
                    "%s: %s failed before any byte (%s); re-routing to %s",
                    t.request_id,
                    node.node_id,
                    served.http_status,
                    again.node_id,
                )
                node, sent = again, p  # (the prefill leg's KV is on the failed node's side)
                self.proxied.sent(f, node.node_id)
                reroutes += 1
        finally:
            await self.proxied.served(f, served, reroutes, resumes)

    async def _resume(
        self,
        request: Request,
        reply: Reply,
        t: Taken,
        f: Flight,
        ask: Ask,
        node: NodeView,
        trail: Trail,
    ) -> tuple[Served, int]:
        """``node``'s engine broke the stream mid-answer: the rest from the best other node
        (router/http/resume.py), on the same stream and the same reservation, each attempt a
        recorded decision; the error event when none can give it. What serving produced, and
        how many continuations were sent."""
        p, g, s = t.parsed, t.gated, self.settings
        first_ttft = f.first_token_s and f.first_token_s - t.started
        failed, resumes = [node.node_id], 0
        served = Served(status="error", broken=True, error=f"{node.node_id} failed mid-stream")
        while served.broken and resumes < s.stream_resumes:
            body = continuation(p, trail)
            if body is None:  # every token asked for was sent: the answer ends here
                served = Served(status="ok", http_status=200, output_tokens=trail.tokens)
                await end_stream(reply, StallBudget(s.stream_write_timeout_s))
                break
            again = self.director.reroute(ask, g, failed, p, why="resume")
            if again is None:
                break
            try:
                cont = self.reader.parse(body, p.chat)
            except Refusal as exc:  # (the continuation outgrew a limit of the request's)
                served.error = f"cannot continue: {exc.message}"
                break
            node = again
            self.proxied.sent(f, node.node_id)
            resumes += 1
            log.warning("%s: continuing its stream on %s", t.request_id, node.node_id)
            served, whole = await self._forward(
                request, reply, t, f, node, cont, trail, Splice(p, trail)
            )
            if whole is not None:  # refused before its first byte: as good as broken
                served.broken, served.error = True, f"{node.node_id}: {whole.status}"
            failed.append(node.node_id)
        self.director.metrics.resumes.labels("failed" if served.broken else "resumed").inc()
        if served.broken:  # no node could continue it
            served.broken = False
            public = "the engine serving this request failed and no other node could continue it"
            await end_stream(reply, StallBudget(s.stream_write_timeout_s), public)
        served.ttft_s = first_ttft if first_ttft is not None else served.ttft_s
        if served.usage is None:
            served.output_tokens = trail.tokens
        return served, resumes

    async def _forward(
        self,
        request: Request,
        reply: Reply,
        t: Taken,
        f: Flight,
        node: NodeView,
        p: ParsedRequest,
        trail: Trail | None = None,
        splice: Splice | None = None,
    ) -> tuple[Served, Whole | None]:
        """Forward to ``node``; a whole answer (not streamed, or a failure before any byte)
        comes back unsent: the caller sends it, or tries another node instead."""
        s = self.settings
        p = self.entry.for_node(p, t.gated.tenant.name, node)
        with self.tracing.span(
            "kvgate.proxy", {"kvgate.node": node.node_id, "kvgate.model": p.model}
        ) as span:
            sending = forward(
                self.upstream.pools,
                request.headers,
                reply,
                t.request_id,
                node,
                p,
                t.started,
                on_first_token=lambda: self.proxied.first_token(f, node.node_id),
                stall=StallBudget(
                    s.stream_write_timeout_s,
                    s.stall_budget_s,
                    lambda: self.director.pressure.contended(t.gated.budget[0], time.time()),
                ),
                send_buffer_bytes=s.stream_send_buffer_bytes,
                max_duration_s=max(0.0, s.max_stream_s - (time.time() - t.started)),
                # with tracing on the engine continues this span, not the client's
                upstream_headers={**self.upstream.auth, **self.tracing.inject()},
                trail=trail,
                splice=splice,
                on_stream=None if trail is None else _cuttable(f, trail),
            )
            if self._sheddable(t, f, reply):
                served, whole = await preemptible(f, reply, sending, t.request_id, node)
            else:
                served, whole = await sending
            if span is not None:
                span.set_attribute("http.response.status_code", served.http_status)
                span.set_attribute("kvgate.output_tokens", served.output_tokens)
        ended = served.status in ("cancelled", "preempted")  # (says nothing of the engine)
        self.director.observe(node.node_id, served.failure, ended)
        if self.feed.state != "live" and served.http_status == 502 and not reply.started:
            self.feed.down.add(node.node_id)  # until it answers a probe again
        return served, whole

    def _sheddable(self, t: Taken, f: Flight, reply: Reply) -> bool:
        """Whether the answer about to be asked for may be preempted until its first token
        (router/flow/preemption.py): an admitted stream of a sheddable priority that has sent
        nothing yet."""
        a = self.director.gate.settings
        return (
            a.preemption
            and t.admitted
            and t.parsed.stream
            and not reply.started
            and f.first_token_s is None
            and t.gated.tenant.priority in a.preempt_priorities
        )

    async def models(self, request: Request, reply: Reply) -> None:
        """The fleet's models, answered here (and recorded: no request goes unrecorded)."""
        tenant = self.entry.reader.tenant(request.headers)
        client_id = client_label(request.headers, "X-Request-Id", self.settings.client_id_max_len)
        request_id = self.passing.listed(tenant, client_id)
        now = time.time()
        json_answer(
            reply, model_list(self.views.nodes(now), now), 200, {"X-Request-Id": request_id}
        )

    async def passthrough(self, request: Request, reply: Reply) -> None:
        """``POST`` of an allow-listed non-generating endpoint, to a node serving its model."""
        raw = request.body
        model = request_model(raw)
        now = time.time()
        node = passthrough_node(self.views.nodes(now), model, now, self.settings.max_queue)
        request_id = mint_id()
        tenant = self.entry.reader.tenant(request.headers)
        client_id = client_label(request.headers, "X-Request-Id", self.settings.client_id_max_len)
        kind = PASSTHROUGH[request.path]
        held = await self.passing.admit(request_id, kind, tenant, model, raw, node, client_id)
        headers = {
            "X-Request-Id": request_id,
            **trace_headers(request.headers),
            **node.engine_headers,
            **self.upstream.auth,
        }
        http_status, error, cancelled = 502, None, True
        try:
            http_status, error = await relay(
                self.upstream.session, request, reply, node, raw, headers
            )
            cancelled = False
        except Refusal as exc:
            http_status, error, cancelled = exc.status, exc.message, False
            raise
        finally:  # (cancelled: the client went away while the engine computed)
            done = self.passing.finished(request_id, node, held, now, http_status, error, cancelled)
            await asyncio.shield(done)

    async def not_served(self, request: Request, _: Reply) -> None:
        """A ``POST /v1/…`` kvgate neither serves nor passes through: engine admin endpoints
        (``/v1/load_lora_adapter``…), unknown paths."""
        path = request.path[:200]
        raise Refusal(404, f"no such endpoint: {path}", "NotFoundError", reason="not_served")
