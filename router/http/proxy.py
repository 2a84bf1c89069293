"""Forwarding one request to an engine and relaying the answer, unbuffered.

The relay learns what the outcome needs on the way (time to the first token, output tokens, the
engine's usage with cached tokens) without holding back any byte. For streams it asks the engine
for a usage chunk and drops it again when the client did not ask for one. A client that goes away
closes the upstream connection (the engine aborts the request and frees its KV blocks); an engine
that fails before the first byte becomes a 502, after it a final SSE error event (neither names
an internal address: the details go to the log).

A streaming client that takes nothing for its :class:`StallBudget` (seconds while others wait
for KV, the write timeout otherwise) is cut off, and no request runs past ``max_duration_s``:
either way the upstream request is closed and the caller releases the reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson

from router.decision.types import NodeView
from router.flow.headers import trace_headers
from router.flow.served import Served
from router.http.resume import Splice, Trail
from router.http.sse import SseLines
from router.parse import ParsedRequest
from router.wire.client import Answer, Cut, Pools, UpstreamError
from router.wire.server import ClientGone, Reply
from streams.agentapis import Api, usage_as_chat
from streams.openai import error_body

__all__ = ["StallBudget", "Whole", "end_stream", "forward"]

log = logging.getLogger(__name__)


class ClientStalled(Exception):
    """The client stopped taking the stream."""


@dataclass(frozen=True, slots=True)
class StallBudget:
    """How long a stream's client may take nothing: ``budget_s`` while ``contended()`` says
    others wait for the KV it holds, ``timeout_s`` in any case."""

    timeout_s: float = 30.0
    budget_s: float = 0.0  # 0: only the timeout
    contended: Callable[[], bool] | None = None


_CHECK_S = 0.5  # past the budget, how often a waiting write asks whether the pool is contended


async def _write(reply: Reply, data: bytes, stall: StallBudget) -> None:
    """Write ``data`` to the client, giving up on a client that takes nothing (``stall``). A
    write only waits while the client's buffers are full; the common case (the kernel takes
    every SSE chunk) goes without a timer."""
    if reply.write_nowait(data):
        return
    if not stall.budget_s or stall.contended is None or stall.budget_s >= stall.timeout_s:
        try:
            async with asyncio.timeout(stall.timeout_s):
                await reply.drain()
        except TimeoutError:
            raise ClientStalled(f"client took nothing for {stall.timeout_s:g} s") from None
        return
    loop = asyncio.get_running_loop()
    start = loop.time()
    drained = asyncio.ensure_future(reply.drain())
    try:
        wait = stall.budget_s
        while True:
            done, _ = await asyncio.wait({drained}, timeout=wait)
            if done:
                drained.result()
                return
            waited = loop.time() - start
            if waited >= stall.timeout_s:
                raise ClientStalled(f"client took nothing for {stall.timeout_s:g} s")
            if stall.contended():
                raise ClientStalled(
                    f"client took nothing for {waited:.1f} s while others wait for KV"
                )
            wait = min(_CHECK_S, stall.timeout_s - waited)
    finally:
        if not drained.done():
            drained.cancel()


@dataclass(frozen=True, slots=True)
class Whole:
    """An answer sent whole (not streamed, or a failure before any byte), not sent yet."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    def send(self, reply: Reply) -> None:
        reply.send(self.status, self.body, self.content_type, self.headers)


def _error(status: int, message: str, kind: str) -> Whole:
    return Whole(status, orjson.dumps(error_body(message, kind, status)))


def _whole(
    status: int,
    data: bytes,
    content_type: str,
    relay: Served,
    node: NodeView,
    headers: tuple[tuple[str, str], ...],
    started: float,
    on_first_token: Callable[[], None] | None,
    api: Api = "chat",
) -> Whole:
    """An answer that is not streamed (or an error), passed on, less an engine's refusal of the
    router's own credentials (a 502: the client did nothing wrong)."""
    relay.ttft_s = time.time() - started
    if status == 200:
        relay.usage = usage_as_chat(api, orjson.loads(data).get("usage"))
        relay.status = "ok"
        if on_first_token is not None:  # the prompt was prefilled
            on_first_token()
    else:
        relay.error = data[:500].decode("utf-8", "replace")
    if status in (401, 403):  # the engine refused the router, not the client
        relay.http_status, relay.failure = 502, "5xx"
        return _error(502, f"node {node.node_id} refused the router's credentials", "upstream_auth")
    return Whole(status, data, content_type or "application/json", headers)


async def _failed(
    exc: BaseException,
    overdue: float | None,
    relay: Served,
    node: NodeView,
    reply: Reply,
    request_id: str,
    stall: StallBudget,
    trail: Trail | None = None,
) -> Whole | None:
    """The engine failed (or, ``overdue`` set to ``max_duration_s``, the request ran past it):
    a 502/504 before the first byte, else a final SSE error event on the open stream — unless
    the stream can go on elsewhere (``trail``: the relay comes back ``broken``, nothing
    written) or its answer was whole already (its finish reason sent: it ends with
    ``[DONE]``). The client never sees an internal address (the log does)."""
    relay.error = f"upstream {node.node_id} failed: {exc!r}"
    public = f"engine {node.node_id} failed while serving this request"
    if overdue is None:
        if not isinstance(exc, Cut):  # (the router ended it: no failure of the engine's)
            relay.failure = "timeout" if isinstance(exc, TimeoutError) else "connect"
        if reply.started and trail is not None and (trail.resumable or trail.finished):
            log.warning("%s: %s mid-stream", request_id, relay.error)
            relay.broken = trail.resumable
            if trail.finished:
                relay.status = "ok"
                await end_stream(reply, stall)
            return None
    else:
        relay.error = f"request ran past max_duration_s ({overdue:g} s)"
        public = relay.error
        relay.http_status = 504
        relay.cut_off = True
    log.warning("%s: %s", request_id, relay.error)
    if not reply.started:
        if overdue is not None:
            return _error(504, public, "GatewayTimeout")
        return _error(502, public, "BadGateway")
    await end_stream(reply, stall, public)
    return None


async def end_stream(reply: Reply, stall: StallBudget, error: str | None = None) -> None:
    """A stream's last events when its engine is gone: the ``error`` (when it failed the
    answer), then ``[DONE]``."""
    last = b"data: [DONE]\n\n"
    if error is not None:
        last = b"data: " + orjson.dumps(error_body(error, "BadGateway", 502)) + b"\n\n" + last
    try:
        await _write(reply, last, stall)
        reply.end()
    except (ClientGone, ClientStalled):
        pass


def _upstream_body(p: ParsedRequest) -> bytes:
    """The body for the engine: a stream asks for the usage chunk (the relay drops it again
    when the client did not ask for it)."""
    body = p.body
    if p.stream and not p.include_usage:
        body = {
            **body,
            "stream_options": {**(body.get("stream_options") or {}), "include_usage": True},
        }
    return orjson.dumps(body)


async def _stream(
    up: Answer,
    reply: Reply,
    relay: Served,
    headers: tuple[tuple[str, str], ...],
    p: ParsedRequest,
    started: float,
    on_first_token: Callable[[], None] | None,
    stall: StallBudget,
    send_buffer_bytes: int,
    trail: Trail | None,
    splice: Splice | None,
) -> None:
    """The engine's stream to the client as it comes (see :class:`SseLines`); a
    continuation (``splice``) goes on the stream already started. The client's response
    starts with the engine's first event, not with its headers: until then nothing was sent,
    and the request may still go to another node (or be preempted) with a clean status."""

    def begin() -> None:
        if not reply.started:
            reply.bound(send_buffer_bytes)
            reply.start(200, "text/event-stream", (*headers, ("Cache-Control", "no-cache")))

    lines = SseLines(relay, p.include_usage, on_first_token, started, p.api, trail, splice)

    def take(data: bytes) -> bool:
        """A piece relayed as it arrives (the connection's callback); False: the client's
        buffer is full (the loop below waits for it, with the stall budget)."""
        out = lines.feed(data)
        if not out:
            return True
        begin()
        return reply.write_nowait(out)

    async for data in up.chunks(take):  # as the engine wrote it
        if not data:  # ``take`` wrote, and the client's buffer is full
            await _write(reply, b"", stall)
            continue
        out = lines.feed(data)
        if out:
            begin()
            await _write(reply, out, stall)
    out = lines.feed(b"", final=True)
    begin()
    if out:
        await _write(reply, out, stall)
    reply.end()
    relay.status = "ok"


async def forward(
    pools: Pools,
    client_headers: Mapping[str, str],
    reply: Reply,
    request_id: str,
    node: NodeView,
    p: ParsedRequest,
    started: float,
    on_first_token: Callable[[], None] | None = None,
    *,
    stall: StallBudget = StallBudget(),
    max_duration_s: float = 3600.0,
    send_buffer_bytes: int = 64 << 10,
    upstream_headers: Mapping[str, str] | None = None,
    trail: Trail | None = None,
    splice: Splice | None = None,
    on_stream: Callable[[Answer | None], None] | None = None,
) -> tuple[Served, Whole | None]:
    """Send ``p`` to ``node`` and relay the answer: a stream to ``reply`` as it comes; a whole
    answer (or a failure before any byte) comes back as a :class:`Whole`, unsent. With a
    ``trail``, a stream the engine breaks after the client got bytes comes back ``broken``
    (nothing more written) when it can be continued elsewhere; ``splice``: this is such a
    continuation (router/http/resume.py); ``on_stream`` is told of the engine's stream while
    it is relayed (then None)."""
    relay = Served()
    headers = (("X-Kvgate-Node", node.node_id), ("X-Request-Id", request_id))
    sent = {
        "Content-Type": "application/json",
        "X-Request-Id": request_id,
        **trace_headers(client_headers),
        **node.engine_headers,
        **(upstream_headers or {}),
    }.items()
    deadline = asyncio.timeout(max_duration_s)
    try:
        async with deadline:
            pool, prefix = pools.of(node.endpoint)
            up = await pool.request("POST", prefix + p.path, _upstream_body(p), sent)
            try:
                relay.http_status = up.status
                if up.status >= 500:
                    relay.failure = "5xx"
                if not p.stream or up.status != 200:
                    data = await up.read()
                    whole = _whole(
                        up.status,
                        data,
                        up.content_type,
                        relay,
                        node,
                        headers,
                        started,
                        on_first_token,
                        p.kind,
                    )
                    return relay, whole
                if on_stream is not None:
                    on_stream(up)
                await _stream(
                    up,
                    reply,
                    relay,
                    headers,
                    p,
                    started,
                    on_first_token,
                    stall,
                    send_buffer_bytes,
                    trail,
                    splice,
                )
                return relay, None
            finally:
                if on_stream is not None:
                    on_stream(None)
                up.release()  # (closes the engine's connection unless the answer was whole)
    except ClientStalled as exc:
        relay.status, relay.error, relay.cut_off = "cancelled", str(exc), True
        log.warning("%s: %s; cut off", request_id, exc)
        reply.abort()
        return relay, None
    except ClientGone as exc:
        relay.status, relay.error = "cancelled", f"client disconnected: {exc}"
        return relay, None
    except (UpstreamError, TimeoutError) as exc:
        overdue = max_duration_s if deadline.expired() else None
        return relay, await _failed(exc, overdue, relay, node, reply, request_id, stall, trail)
    finally:
        if relay.usage is not None:
            relay.output_tokens = int(relay.usage.get("completion_tokens", relay.output_tokens))
