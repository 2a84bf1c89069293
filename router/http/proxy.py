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
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.decision.types import NodeView
from router.flow.headers import trace_headers
from router.flow.served import Served
from router.http.edge import json_response
from router.parse import ParsedRequest
from streams.openai import error_body

__all__ = ["StallBudget", "forward"]

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


async def _write(
    resp: web.StreamResponse,
    data: bytes,
    stall: StallBudget,
    transport: Any = None,
    high_water: int = 0,
) -> None:
    """Write ``data`` to the client, giving up on a client that takes nothing (``stall``). A
    write can only wait when the connection's ``transport`` is paused (its buffer above
    ``high_water``); with nothing buffered and less than that to write it cannot be, and the
    write goes without a timer (the common case: the kernel takes every SSE chunk)."""
    if (
        transport is not None
        and len(data) < high_water
        and not transport.is_closing()
        and transport.get_write_buffer_size() == 0
    ):
        await resp.write(data)
        return
    if not stall.budget_s or stall.contended is None or stall.budget_s >= stall.timeout_s:
        try:
            async with asyncio.timeout(stall.timeout_s):
                await resp.write(data)
        except TimeoutError:
            raise ClientStalled(f"client took nothing for {stall.timeout_s:g} s") from None
        return
    loop = asyncio.get_running_loop()
    start = loop.time()
    write = asyncio.ensure_future(resp.write(data))
    try:
        wait = stall.budget_s
        while True:
            done, _ = await asyncio.wait({write}, timeout=wait)
            if done:
                write.result()
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
        if not write.done():
            write.cancel()


def _bound_send_buffer(request: web.Request, size: int) -> None:
    """A stream's client connection buffers at most about ``size`` bytes in the kernel and as
    much in the transport: a client that stops reading shows as a blocked write soon."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    limits = getattr(transport, "set_write_buffer_limits", None)  # (uvloop's transports
    if limits is not None:  # are not asyncio.WriteTransport instances)
        limits(high=size)


def _has_text(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries the first generated token: text, content, reasoning
    (vLLM's ``reasoning_content``, newer ``reasoning``) or a tool call."""
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))


class _SseLines:
    """Reads an engine's SSE stream chunk by chunk as it arrives: notes the first token, the
    output tokens and the usage, and returns the bytes for the client — the complete lines of
    the chunk, less the usage chunk the router asked for on the client's behalf (and its blank
    line). A line split over chunks waits for its end."""

    __slots__ = ("first_token", "include_usage", "relay", "rest", "skip_blank", "started")

    def __init__(
        self,
        relay: Served,
        include_usage: bool,
        first_token: Callable[[], None] | None,
        started: float,
    ) -> None:
        self.relay, self.include_usage = relay, include_usage
        self.first_token, self.started = first_token, started
        self.rest = b""
        self.skip_blank = False

    def feed(self, data: bytes, final: bool = False) -> bytes:
        """The client's bytes of ``data`` (``final``: the stream ended; an unterminated last
        line counts as a line)."""
        if self.rest:
            data, self.rest = self.rest + data, b""
        end = len(data) if final else data.rfind(b"\n") + 1
        if end < len(data):
            data, self.rest = data[:end], data[end:]
        if not data:
            return b""
        if b"data: {" not in data and not self.skip_blank:
            return data  # keep-alives, comments, blank lines, [DONE]: nothing to look at
        kept: list[bytes] = []
        at = 0
        while at < len(data):
            nl = data.find(b"\n", at) + 1 or len(data)
            line, at = data[at:nl], nl
            if self.skip_blank:
                self.skip_blank = False
                if line in (b"\n", b"\r\n"):
                    continue
            if line.startswith(b"data: {") and not self._look(line):
                self.skip_blank = True  # the usage chunk we asked for: not the client's
                continue
            kept.append(line)
        return b"".join(kept)

    def _look(self, line: bytes) -> bool:
        """Whether the client gets this data line."""
        relay = self.relay
        chunk = orjson.loads(line[6:])
        if chunk.get("usage"):
            relay.usage = chunk["usage"]
            if not chunk.get("choices") and not self.include_usage:
                return False
        choices = chunk.get("choices")
        if choices and _has_text(choices[0]):
            relay.output_tokens += 1
            if relay.ttft_s is None:
                relay.ttft_s = time.time() - self.started
                if self.first_token is not None:
                    self.first_token()
        return True


async def _whole(
    up: aiohttp.ClientResponse,
    relay: Served,
    node: NodeView,
    headers: dict[str, str],
    started: float,
    on_first_token: Callable[[], None] | None,
) -> web.Response:
    """An answer that is not streamed (or an error): read whole and passed on, less an
    engine's refusal of the router's own credentials (a 502: the client did nothing wrong)."""
    data = await up.read()
    relay.ttft_s = time.time() - started
    if up.status == 200:
        relay.usage = orjson.loads(data).get("usage")
        relay.status = "ok"
        if on_first_token is not None:  # the prompt was prefilled
            on_first_token()
    else:
        relay.error = data[:500].decode("utf-8", "replace")
    if up.status in (401, 403):  # the engine refused the router, not the client
        relay.http_status, relay.failure = 502, "5xx"
        msg = f"node {node.node_id} refused the router's credentials"
        return json_response(error_body(msg, "upstream_auth", 502), 502)
    return web.Response(
        body=data,
        status=up.status,
        headers=headers,
        content_type=up.content_type or "application/json",
    )


async def _failed(
    exc: BaseException,
    overdue: float | None,
    relay: Served,
    node: NodeView,
    resp: web.StreamResponse | None,
    request_id: str,
    stall: StallBudget,
) -> web.StreamResponse:
    """The engine failed (or, ``overdue`` set to ``max_duration_s``, the request ran past it):
    a 502/504 before the first byte, else a final SSE error event on the open stream. The
    client never sees an internal address (the log does)."""
    relay.error = f"upstream {node.node_id} failed: {exc!r}"
    public = f"engine {node.node_id} failed while serving this request"
    if overdue is None:
        relay.failure = "timeout" if isinstance(exc, TimeoutError) else "connect"
    else:
        relay.error = f"request ran past max_duration_s ({overdue:g} s)"
        public = relay.error
        relay.http_status = 504
        relay.cut_off = True
    log.warning("%s: %s", request_id, relay.error)
    if resp is None:
        code = 504 if overdue is not None else 502
        kind = "GatewayTimeout" if overdue is not None else "BadGateway"
        return json_response(error_body(public, kind, code), code)
    err = orjson.dumps(error_body(public, "BadGateway", 502))
    try:
        await _write(resp, b"data: " + err + b"\n\ndata: [DONE]\n\n", stall)
        await resp.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, ClientStalled):
        pass
    return resp


async def forward(
    http: aiohttp.ClientSession,
    request: web.Request,
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
) -> tuple[web.StreamResponse, Served]:
    relay = Served()
    deadline = asyncio.timeout(max_duration_s)
    body = p.body
    if p.stream and not p.include_usage:
        body = {
            **body,
            "stream_options": {**(body.get("stream_options") or {}), "include_usage": True},
        }
    headers = {"X-Kvgate-Node": node.node_id, "X-Request-Id": request_id}
    resp: web.StreamResponse | None = None
    try:
        async with (
            deadline,
            http.post(
                node.endpoint.rstrip("/") + p.path,
                data=orjson.dumps(body),
                headers={
                    "Content-Type": "application/json",
                    "X-Request-Id": request_id,
                    **trace_headers(request.headers),
                    **node.engine_headers,
                    **(upstream_headers or {}),
                },
            ) as up,
        ):
            relay.http_status = up.status
            if up.status >= 500:
                relay.failure = "5xx"
            if not p.stream or up.status != 200:
                whole = await _whole(up, relay, node, headers, started, on_first_token)
                return whole, relay
            resp = web.StreamResponse(
                status=200,
                headers={
                    **headers,
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                },
            )
            _bound_send_buffer(request, send_buffer_bytes)
            await resp.prepare(request)
            lines = _SseLines(relay, p.include_usage, on_first_token, started)
            client = request.transport
            limits = getattr(client, "get_write_buffer_limits", None)
            high = limits()[1] if limits is not None else 0
            async for data in up.content.iter_any():  # as the engine wrote it
                out = lines.feed(data)
                if out:
                    await _write(resp, out, stall, client, high)
            out = lines.feed(b"", final=True)
            if out:
                await _write(resp, out, stall, client, high)
            await resp.write_eof()
            relay.status = "ok"
            return resp, relay
    except ClientStalled as exc:
        relay.status, relay.error, relay.cut_off = "cancelled", str(exc), True
        log.warning("%s: %s; cut off", request_id, exc)
        if request.transport is not None:
            request.transport.abort()
        return (resp if resp is not None else web.Response(status=499)), relay
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
        relay.status, relay.error = "cancelled", f"client disconnected: {exc}"
        return (resp if resp is not None else web.Response(status=499)), relay
    except (aiohttp.ClientError, TimeoutError) as exc:
        overdue = max_duration_s if deadline.expired() else None
        failed = await _failed(exc, overdue, relay, node, resp, request_id, stall)
        return failed, relay
    finally:
        if relay.usage is not None:
            relay.output_tokens = int(relay.usage.get("completion_tokens", relay.output_tokens))
