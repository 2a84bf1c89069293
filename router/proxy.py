"""Forwarding one request to an engine and relaying the answer, unbuffered.

The relay learns what the outcome needs on the way (time to the first token, output tokens, the
engine's usage with cached tokens) without holding back any byte. For streams it asks the engine
for a usage chunk and drops it again when the client did not ask for one. A client that goes away
closes the upstream connection (the engine aborts the request and frees its KV blocks); an engine
that fails before the first byte becomes a 502, after it a final SSE error event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.core import NodeView
from router.parse import ParsedRequest
from streams.openai import error_body

__all__ = ["Relay", "forward"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Relay:
    """What happened on the way through."""

    status: str = "error"  # ok | error | cancelled
    http_status: int = 502
    ttft_s: float | None = None
    output_tokens: int = 0
    usage: dict[str, Any] | None = None
    error: str | None = None

    @property
    def cached_tokens(self) -> int | None:
        if self.usage is None:
            return None
        cached = (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return None if cached is None else int(cached)


def _json(data: Any, status: int) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _has_text(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content"))


async def forward(
    http: aiohttp.ClientSession,
    request: web.Request,
    request_id: str,
    node: NodeView,
    p: ParsedRequest,
    started: float,
    on_first_token: Callable[[], None] | None = None,
) -> tuple[web.StreamResponse, Relay]:
    relay = Relay()
    body = p.body
    if p.stream and not p.include_usage:
        body = {
            **body,
            "stream_options": {**(body.get("stream_options") or {}), "include_usage": True},
        }
    headers = {"X-Kvgate-Node": node.node_id, "X-Request-Id": request_id}
    resp: web.StreamResponse | None = None
    try:
        async with http.post(
            node.endpoint.rstrip("/") + p.path,
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", "X-Request-Id": request_id},
        ) as up:
            relay.http_status = up.status
            if not p.stream or up.status != 200:
                data = await up.read()
                relay.ttft_s = time.time() - started
                if up.status == 200:
                    relay.usage = orjson.loads(data).get("usage")
                    relay.status = "ok"
                    if on_first_token is not None:  # the prompt was prefilled
                        on_first_token()
                else:
                    relay.error = data[:500].decode("utf-8", "replace")
                return web.Response(
                    body=data,
                    status=up.status,
                    headers=headers,
                    content_type=up.content_type or "application/json",
                ), relay
            resp = web.StreamResponse(
                status=200,
                headers={
                    **headers,
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
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
                        relay.usage = chunk["usage"]
                        if not chunk.get("choices") and not p.include_usage:
                            skip_blank = True  # the usage chunk we asked for: not the client's
                            continue
                    if chunk.get("choices") and _has_text(chunk["choices"][0]):
                        relay.output_tokens += 1
                        if relay.ttft_s is None:
                            relay.ttft_s = time.time() - started
                            if on_first_token is not None:
                                on_first_token()
                await resp.write(line)
            await resp.write_eof()
            relay.status = "ok"
            return resp, relay
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
        relay.status, relay.error = "cancelled", f"client disconnected: {exc}"
        return (resp if resp is not None else web.Response(status=499)), relay
    except (aiohttp.ClientError, TimeoutError) as exc:
        relay.error = f"upstream {node.node_id} failed: {exc!r}"
        log.warning("%s", relay.error)
        if resp is None:
            return _json(error_body(relay.error, "BadGateway", 502), 502), relay
        err = orjson.dumps(error_body(relay.error, "BadGateway", 502))
        try:
            await resp.write(b"data: " + err + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        return resp, relay
    finally:
        if relay.usage is not None:
            relay.output_tokens = int(relay.usage.get("completion_tokens", relay.output_tokens))
