"""The rest of the engines' OpenAI API passes through the router to a node serving the model:
authenticated, bounded, streamed back, with the node named; kvgate's own paths and unknown
models are not passed on."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from streams.codec import decode
from streams.schemas import Outcome
from streams.topics import OUTCOMES
from tests.edgekit import MODEL, _serve, bearer, edge, raw_http


async def test_embeddings_and_other_endpoints_reach_a_node_of_the_model() -> None:
    seen: list[tuple[str, dict[str, Any], Any]] = []

    async def embeddings(request: web.Request) -> web.Response:
        seen.append((request.path_qs, await request.json(), request.headers.copy()))
        body = {"object": "list", "data": [{"index": 0, "embedding": [0.1, 0.2]}]}
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/score", embeddings)
    runner, url = await _serve(app)
    try:
        async with edge(router={"upstream_api_key": "engine-key-0123"}) as e:
            for node in e.engines:
                e.engines[node] = url
            body = {"model": MODEL, "input": "hello"}
            for _ in range(50):  # until a heartbeat carried the capturing endpoint
                status, out, headers = await e.call(
                    "POST", "/v1/embeddings", body, bearer("sk-alpha")
                )
                if seen:
                    break
                await asyncio.sleep(0.05)
            assert status == 200 and out["data"][0]["embedding"] == [0.1, 0.2]
            assert headers["X-Kvgate-Node"] in e.engines
            path, sent, sent_headers = seen[-1]
            assert path == "/v1/embeddings" and sent == body
            assert sent_headers["Authorization"] == "Bearer engine-key-0123"
            assert len(sent_headers["X-Request-Id"]) == 32  # minted by kvgate
            status, out, _ = await e.call(
                "POST", "/v1/score?verbose=1", {"model": MODEL, "text_1": "a"}, bearer("sk-alpha")
            )
            assert status == 200 and seen[-1][0] == "/v1/score?verbose=1"
            # each has its decision record, under the id the engine was sent
            records = [d for d in e.decisions() if d.policy == "passthrough"]
            assert [d.endpoint_kind for d in records][-2:] == ["embeddings", "score"]
            assert records[-1].request_id == seen[-1][2]["X-Request-Id"]
            assert all(d.tenant == "alpha" and d.chosen_node in e.engines for d in records)

            # the model list is answered by the router, and recorded too
            status, out, headers = await e.call("GET", "/v1/models", None, bearer("sk-alpha"))
            assert status == 200 and [m["id"] for m in out["data"]] == [MODEL]
            (m,) = [d for d in e.decisions() if d.endpoint_kind == "models"]
            assert (m.request_id, m.tenant, m.chosen_node) == (
                headers["X-Request-Id"],
                "alpha",
                None,
            )

            # refusals: no key, no model, unknown model, kvgate's own namespace
            status, _, _ = await e.call("POST", "/v1/embeddings", body, bearer("sk-wrong"))
            assert status == 401
            status, out, _ = await e.call(
                "POST", "/v1/embeddings", {"input": "x"}, bearer("sk-alpha")
            )
            assert status == 400 and "model" in out["error"]["message"]
            status, _, _ = await e.call(
                "POST", "/v1/embeddings", {"model": "nope", "input": "x"}, bearer("sk-alpha")
            )
            assert status == 404
            status, _, _ = await e.call("POST", "/v1/kvgate/unknown", body, bearer("sk-alpha"))
            assert status == 404
            status, _, _ = await e.call(
                "POST", "/v1/embeddings", data=b"not json", headers=bearer("sk-alpha")
            )
            assert status == 400
    finally:
        await runner.cleanup()


async def test_no_path_reaches_an_engine_endpoint_outside_the_allow_list() -> None:
    """Dot segments, encodings and engine admin or unadmitted generating endpoints under /v1
    are refused by the router (400 / 404) and never reach an engine, even with a valid key
    and with the router adding the engine's own key."""
    seen: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append(request.raw_path)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner, url = await _serve(app)
    try:
        async with edge(router={"upstream_api_key": "engine-key-0123"}) as e:
            for node in e.engines:
                e.engines[node] = url
            body = orjson.dumps({"model": MODEL, "input": "hello"})
            port = int(e.url.rsplit(":", 1)[1])

            async def post(path: str) -> int:
                head = (
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-alpha\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n"
                ).encode()
                answer = await raw_http(port, head + body)
                return int(answer.split(b" ", 2)[1])

            for _ in range(50):  # until a heartbeat carried the capturing endpoint
                if await post("/v1/embeddings") == 200 and seen:
                    break
                await asyncio.sleep(0.05)
            assert seen == ["/v1/embeddings"]
            traversals = [
                "/v1/../reset_prefix_cache",
                "/v1/%2e%2e/reset_prefix_cache",
                "/v1/%2E%2E/reset_prefix_cache",
                "/v1/embeddings/../../reset_prefix_cache",
                "/v1/./embeddings/..%2F..%2Freset_prefix_cache",
                "/v1/embeddings%2F..%2F..%2Freset_prefix_cache",
                "/v1/..%2freset_prefix_cache",
                "/v1//embeddings",
                "/v1/.%2e/sleep",
                "/v1/embeddings/..\\..\\reset_prefix_cache",
            ]
            for path in traversals:
                assert await post(path) == 400, path
            for path in (
                "/v1/load_lora_adapter",
                "/v1/unload_lora_adapter",
                "/v1/embeddings/extra",
                "/v1/kvgate/anything",
            ):
                assert await post(path) == 404, path
            # the engine path is kvgate's constant, whatever the client's spelling
            assert await post("/v1/score?x=1") == 200
            assert seen == ["/v1/embeddings", "/v1/score?x=1"]
    finally:
        await runner.cleanup()


async def test_a_passthrough_request_holds_its_input_kv_while_the_engine_computes() -> None:
    """Embeddings use an engine: admitted against the model's budget for the KV of their input
    while the engine computes, released with the answer; refused, and recorded as refused, when
    admission will not take them (here: an input larger than any node's KV)."""
    gate = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await gate.wait()
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_post("/v1/embeddings", slow)
    runner, url = await _serve(app)
    try:
        async with edge(blocks=200) as e:
            for node in e.engines:
                e.engines[node] = url
            await asyncio.sleep(0.5)  # the heartbeats carry the slow endpoint
            body = {"model": MODEL, "input": "word " * 1000}  # ~5,000 bytes: ~1,250 tokens
            sent = asyncio.create_task(e.call("POST", "/v1/embeddings", body, bearer("sk-alpha")))
            for _ in range(100):
                if await e.reservations():
                    break
                await asyncio.sleep(0.02)
            assert await e.reservations() == 1
            (d,) = [d for d in e.decisions() if d.policy == "passthrough"]
            assert d.admission == "admitted" and d.kv_blocks_estimate >= 1250 // 16
            # a request far past what the two nodes hold: refused, recorded as such
            huge = {"model": MODEL, "input": "word " * 60_000}
            status, out, _ = await e.call("POST", "/v1/embeddings", huge, bearer("sk-alpha"))
            assert status == 413 and out["error"]["type"] == "too_large", out
            refused = [d for d in e.decisions() if d.policy == "passthrough"][-1]
            assert refused.admission == "rejected" and refused.chosen_node is None
            gate.set()
            status, _, _ = await sent
            assert status == 200
            assert await e.reservations() == 0
            (o,) = [decode(Outcome, v) for v in e.published(OUTCOMES.suffix)]
            assert (o.request_id, o.status, o.http_status) == (d.request_id, "ok", 200)
            assert o.node_id == d.chosen_node and o.e2e_s > 0 and o.output_tokens == 0
    finally:
        await runner.cleanup()
