"""The router's HTTP service: an OpenAI-compatible proxy that routes each request.

Per request: validate → tokenize and chain-hash → snapshot the replicas → policy decides →
publish the decision → forward to the engine and stream the answer back unbuffered → publish the
outcome. Kafka publishing never waits on the broker.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from pydantic import ValidationError

from router.core import NodeView, Policy, RouteDecision, RouteRequest, eligible
from router.metrics import RouterMetrics
from router.pending import PendingDispatches
from router.settings import RouterSettings
from streams.blocks import approx_tokenize, chain_hashes
from streams.kafka import KafkaBus
from streams.openai import ChatRequest, CompletionRequest, error_body, render_chat
from streams.replica import TableReplica
from streams.schemas import CandidateScore, Decision, Outcome
from streams.topics import DECISIONS, OUTCOMES

__all__ = ["RouterService"]

log = logging.getLogger(__name__)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


@dataclass(slots=True)
class _Parsed:
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    tokens: list[int]
    max_tokens: int
    chat: bool
    session_id: str | None


class RouterService:
    def __init__(
        self, settings: RouterSettings, replica: TableReplica, bus: KafkaBus, policy: Policy
    ) -> None:
        self.settings = settings
        self.replica = replica
        self.bus = bus
        self.policy = policy
        self.router_id = (
            settings.router_id or f"{socket.gethostname()}:{settings.port}:{os.getpid()}"
        )
        self.pending = PendingDispatches()
        self.metrics = RouterMetrics()
        self._http: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/kvgate/decide", self._decide)
        app.router.add_get("/v1/kvgate/state", self._state)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

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

    async def _stop(self, _: web.Application) -> None:
        if self._http is not None:
            await self._http.close()

    # --- snapshot ------------------------------------------------------------------------
    def nodes(self, now: float) -> list[NodeView]:
        out = []
        for hb in self.replica.load.values():
            out.append(
                NodeView(
                    node_id=hb.node_id,
                    endpoint=hb.endpoint,
                    model=hb.model,
                    pool=hb.pool,
                    block_size=hb.block_size,
                    kv_blocks_total=hb.kv_blocks_total,
                    kv_blocks_used=hb.kv_blocks_used,
                    running=hb.running,
                    waiting=hb.waiting,
                    healthy=hb.healthy,
                    draining=hb.draining,
                    heartbeat_ts=hb.ts,
                    lease_s=self.settings.stale_heartbeat_s or hb.lease_s,
                    pending=self.pending.unreflected(hb.node_id, hb.ts, now),
                )
            )
        return out

    # --- endpoints -----------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    def _parse(self, raw: bytes, chat: bool) -> _Parsed:
        body = orjson.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")  # noqa: TRY004 - a 400
        req: ChatRequest | CompletionRequest
        if chat:
            req = ChatRequest.model_validate(body)
            tokens = approx_tokenize(render_chat(req.messages))
        else:
            req = CompletionRequest.model_validate(body)
            tokens = req.prompt_tokens(approx_tokenize)
        session = body.get("user") or request_session(body)
        return _Parsed(
            body=body,
            model=req.model,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            tokens=tokens,
            max_tokens=req.output_limit(self.settings.default_max_tokens),
            chat=chat,
            session_id=session,
        )

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        started = time.time()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            p = self._parse(await request.read(), chat)
        except orjson.JSONDecodeError as exc:
            self.metrics.rejected("bad_json")
            return _json(error_body(f"invalid JSON: {exc}"), 400)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "body"
            self.metrics.rejected("bad_request")
            return _json(error_body(f"{where}: {first['msg']}"), 400)
        except ValueError as exc:
            self.metrics.rejected("bad_request")
            return _json(error_body(str(exc)), 400)

        routed = self._route(request_id, p)
        if routed is None:
            self.metrics.rejected("unknown_model")
            return _json(
                error_body(f"The model `{p.model}` does not exist.", "NotFoundError", 404), 404
            )
        rreq, nodes, decision, decision_us, block_size = routed
        self.metrics.decided(decision.reason, decision_us)
        await self._publish_decision(rreq, p, decision, decision_us, started, block_size)
        if decision.chosen is None:
            await self._publish_outcome(
                request_id, None, "rejected", 503, started, p, error=decision.reason
            )
            return _json(
                error_body("no healthy engine for this model", "ServiceUnavailable", 503),
                503,
                headers={"Retry-After": "1"},
            )
        node = next(n for n in nodes if n.node_id == decision.chosen)
        self.pending.add(node.node_id, request_id, time.time())
        try:
            return await self._forward(request, request_id, node, p, started)
        finally:
            self.pending.finish(request_id)

    def _route(
        self, request_id: str, p: _Parsed
    ) -> tuple[RouteRequest, list[NodeView], RouteDecision, float, int] | None:
        """The decision itself (None: no node serves the model)."""
        t0 = time.perf_counter()
        now = time.time()
        all_nodes = self.nodes(now)
        if not any(n.model == p.model for n in all_nodes):
            return None
        nodes = eligible(all_nodes, p.model, now)
        block_size = nodes[0].block_size if nodes else self.settings.block_size
        hashes = chain_hashes(p.tokens, block_size)
        rreq = RouteRequest(request_id, p.model, hashes, len(p.tokens), p.max_tokens, p.session_id)
        decision = self.policy.decide(rreq, nodes, self.replica.index.match(hashes), now)
        return rreq, nodes, decision, (time.perf_counter() - t0) * 1e6, block_size

    async def _decide(self, request: web.Request) -> web.Response:
        """Dry run: what would the router do with this body (completion or chat)? No events."""
        raw = await request.read()
        try:
            body = orjson.loads(raw)
            p = self._parse(raw, chat=isinstance(body, dict) and "messages" in body)
        except (orjson.JSONDecodeError, ValidationError, ValueError) as exc:
            return _json(error_body(str(exc).splitlines()[0]), 400)
        routed = self._route(uuid.uuid4().hex, p)
        if routed is None:
            return _json(
                error_body(f"The model `{p.model}` does not exist.", "NotFoundError", 404), 404
            )
        rreq, nodes, d, decision_us, block_size = routed
        endpoint = next((n.endpoint for n in nodes if n.node_id == d.chosen), None)
        return _json(
            {
                "chosen_node": d.chosen,
                "endpoint": endpoint,
                "reason": d.reason,
                "prompt_tokens": rreq.prompt_tokens,
                "prompt_blocks": len(rreq.block_hashes),
                "block_size": block_size,
                "decision_us": decision_us,
                "policy": self.policy.name,
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
        return _json(
            {
                "router_id": self.router_id,
                "replica_caught_up": self.replica.caught_up.is_set(),
                "indexed_blocks": len(self.replica.index),
                "nodes": {
                    n.node_id: {
                        "model": n.model,
                        "endpoint": n.endpoint,
                        "alive": n.alive(now),
                        "healthy": n.healthy,
                        "running": n.running,
                        "waiting": n.waiting,
                        "pending": n.pending,
                        "kv_used_ratio": n.kv_used_ratio,
                        "heartbeat_age_s": now - n.heartbeat_ts,
                        "indexed_blocks": len(self.replica.index.blocks_of(n.node_id)),
                    }
                    for n in self.nodes(now)
                },
            }
        )

    async def _forward(
        self, request: web.Request, request_id: str, node: NodeView, p: _Parsed, started: float
    ) -> web.StreamResponse:
        assert self._http is not None
        body = p.body
        if p.stream and not p.include_usage:  # ask for usage to learn cached tokens; strip later
            body = {
                **body,
                "stream_options": {**(body.get("stream_options") or {}), "include_usage": True},
            }
        url = node.endpoint.rstrip("/") + ("/v1/chat/completions" if p.chat else "/v1/completions")
        ttft: float | None = None
        out_tokens = 0
        usage: dict[str, Any] | None = None
        status = "error"
        http_status = 502
        error: str | None = None
        resp: web.StreamResponse | None = None
        try:
            async with self._http.post(
                url,
                data=orjson.dumps(body),
                headers={
                    "Content-Type": "application/json",
                    "X-Request-Id": request_id,
                },
            ) as up:
                http_status = up.status
                if not p.stream or up.status != 200:
                    data = await up.read()
                    ttft = time.time() - started
                    if up.status == 200:
                        parsed = orjson.loads(data)
                        usage = parsed.get("usage")
                        out_tokens = int((usage or {}).get("completion_tokens", 0))
                        status = "ok"
                    else:
                        error = data[:500].decode("utf-8", "replace")
                    return web.Response(
                        body=data,
                        status=up.status,
                        content_type=up.content_type or "application/json",
                    )
                resp = web.StreamResponse(
                    status=200,
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        "X-Kvgate-Node": node.node_id,
                        "X-Request-Id": request_id,
                    },
                )
                await resp.prepare(request)
                skip_blank = False
                async for line in up.content:
                    if skip_blank and line in (b"\n", b"\r\n"):
                        skip_blank = False
                        continue
                    skip_blank = False
                    if line.startswith(b"data: {"):
                        chunk = orjson.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                            if not chunk.get("choices") and not p.include_usage:
                                skip_blank = True
                                continue
                        if chunk.get("choices") and _has_text(chunk["choices"][0]):
                            out_tokens += 1
                            if ttft is None:
                                ttft = time.time() - started
                    await resp.write(line)
                await resp.write_eof()
                status = "ok"
                return resp
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
            # the client went away: leaving the ``async with`` closes the upstream connection,
            # which makes the engine abort the request and free its KV blocks
            status, error = "cancelled", f"client disconnected: {exc}"
            return resp if resp is not None else web.Response(status=499)
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = f"upstream {node.node_id} failed: {exc!r}"
            log.warning("%s", error)
            if resp is None:
                return _json(error_body(error, "BadGateway", 502), 502)
            raise
        finally:
            if usage is not None:
                out_tokens = int(usage.get("completion_tokens", out_tokens))
            await self._publish_outcome(
                request_id,
                node.node_id,
                status,
                http_status,
                started,
                p,
                ttft=ttft,
                out_tokens=out_tokens,
                usage=usage,
                error=error,
            )

    # --- events --------------------------------------------------------------------------
    async def _publish_decision(
        self,
        rreq: RouteRequest,
        p: _Parsed,
        d: RouteDecision,
        decision_us: float,
        started: float,
        block_size: int,
    ) -> None:
        node_ages = [
            started - self.replica.index_updated_s.get(c.node_id, started)
            for c in d.candidates
            if c.hit_blocks
        ]
        await self.bus.publish(
            DECISIONS,
            rreq.request_id,
            Decision(
                request_id=rreq.request_id,
                ts=started,
                router_id=self.router_id,
                model=p.model,
                session_id=p.session_id,
                endpoint_kind="chat" if p.chat else "completions",
                prompt_tokens=len(p.tokens),
                max_tokens=p.max_tokens,
                block_size=block_size,
                block_hashes=list(rreq.block_hashes),
                approximate_tokens=True,
                policy=self.policy.name,
                weights_version=self.policy.weights_version,
                chosen_node=d.chosen,
                reason=d.reason,
                candidates=[
                    CandidateScore(
                        node_id=c.node_id,
                        score=c.score,
                        hit_blocks=c.hit_blocks,
                        hit_fraction=c.hit_fraction,
                        kv_used_ratio=c.kv_used_ratio,
                        queue_len=c.queue_len,
                        healthy=c.healthy,
                        components=dict(c.components),
                    )
                    for c in d.candidates
                ],
                index_age_s=max(node_ages) if node_ages else None,
                decision_us=decision_us,
            ),
        )

    async def _publish_outcome(
        self,
        request_id: str,
        node: str | None,
        status: str,
        http_status: int,
        started: float,
        p: _Parsed,
        *,
        ttft: float | None = None,
        out_tokens: int = 0,
        usage: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        e2e = time.time() - started
        tpot = (e2e - ttft) / (out_tokens - 1) if ttft is not None and out_tokens > 1 else None
        cached = None
        if usage is not None:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        self.metrics.outcome(status)
        await self.bus.publish(
            OUTCOMES,
            request_id,
            Outcome(
                request_id=request_id,
                ts=time.time(),
                router_id=self.router_id,
                node_id=node,
                status=status,
                http_status=http_status,
                ttft_s=ttft,
                tpot_s=tpot,
                e2e_s=e2e,
                prompt_tokens=len(p.tokens),
                output_tokens=out_tokens,
                cached_tokens=cached,
                error=error,
            ),
        )

    # --- introspection -------------------------------------------------------------------
    async def _models(self, _: web.Request) -> web.Response:
        now = time.time()
        models = sorted({n.model for n in self.nodes(now) if n.alive(now)})
        return _json(
            {
                "object": "list",
                "data": [{"id": m, "object": "model", "owned_by": "kvgate"} for m in models],
            }
        )

    async def _health(self, _: web.Request) -> web.Response:
        return _json({"status": "ok", "router_id": self.router_id})

    async def _ready(self, _: web.Request) -> web.Response:
        now = time.time()
        healthy = [n.node_id for n in self.nodes(now) if n.healthy and n.alive(now)]
        ready = self.replica.caught_up.is_set() and bool(healthy)
        return _json(
            {
                "ready": ready,
                "replica_caught_up": self.replica.caught_up.is_set(),
                "healthy_nodes": len(healthy),
                "indexed_blocks": len(self.replica.index),
            },
            200 if ready else 503,
        )

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")


def _has_text(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content"))


def request_session(body: dict[str, Any]) -> str | None:
    """A session key from the body (``session_id`` or ``metadata.session_id``), if any."""
    sid = body.get("session_id")
    if sid is None and isinstance(body.get("metadata"), dict):
        sid = body["metadata"].get("session_id")
    return str(sid) if sid is not None else None
