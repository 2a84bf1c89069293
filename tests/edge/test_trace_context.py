"""W3C trace context reaches the engine: a well-formed ``traceparent`` (and its
``tracestate``) is forwarded, a malformed one never is."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from router.flow.headers import trace_headers
from tests.edgekit import _serve, bearer, completion, edge

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_only_well_formed_trace_context_passes() -> None:
    assert trace_headers({"traceparent": PARENT, "tracestate": "congo=t61rcWkgMzE"}) == {
        "traceparent": PARENT,
        "tracestate": "congo=t61rcWkgMzE",
    }
    for bad in (
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # invalid version
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nX-Evil: 1",
        "",
    ):
        assert trace_headers({"traceparent": bad, "tracestate": "a=b"}) == {}, bad
    assert trace_headers({"traceparent": PARENT, "tracestate": "x" * 600}) == {
        "traceparent": PARENT
    }


async def test_the_engine_receives_the_clients_trace_context() -> None:
    seen: list[dict[str, str]] = []

    async def engine(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        body: dict[str, Any] = {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
        }
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/v1/completions", engine)
    runner, url = await _serve(app)
    try:
        async with edge() as e:
            for node in e.engines:
                e.engines[node] = url
            await e.call("GET", "/health")  # let a heartbeat carry the new endpoints
            headers = {**bearer("sk-alpha"), "traceparent": PARENT, "tracestate": "k=v"}
            for _ in range(50):
                status, _, _ = await e.call("POST", "/v1/completions", completion(), headers)
                if seen:
                    break
                await asyncio.sleep(0.05)
            assert seen, "no request reached the capturing engine"
            assert seen[-1]["traceparent"] == PARENT and seen[-1]["tracestate"] == "k=v"
            bad = {**bearer("sk-alpha"), "traceparent": "not-a-trace"}
            before = len(seen)
            status, _, _ = await e.call("POST", "/v1/completions", completion(), bad)
            assert status == 200 and len(seen) == before + 1
            assert "traceparent" not in seen[-1]
    finally:
        await runner.cleanup()
