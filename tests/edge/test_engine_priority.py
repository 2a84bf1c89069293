"""The body's ``priority`` is the engine's own priority scheduling (vLLM ``--scheduling-policy
priority``): a tenant that sets it jumps the queue of its engine ahead of every other tenant's
requests, whatever kvgate admitted it at. It reaches the engine only for tenants allowed to set
it (``engine_priority``); kvgate removes it for everyone else."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from admission.settings import Tenant
from tests.edgekit import TENANTS, _serve, bearer, completion, edge


async def test_the_engine_priority_field_reaches_engines_only_for_tenants_allowed_to_set_it() -> (
    None
):
    seen: list[dict[str, Any]] = []

    async def engine(request: web.Request) -> web.Response:
        seen.append(await request.json())
        body = {
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1},
        }
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/v1/completions", engine)
    runner, url = await _serve(app)
    tenants = {**TENANTS, "sk-trusted": Tenant(name="trusted", engine_priority=True)}
    try:
        async with edge(admission={"tenants": tenants}) as e:
            for node in e.engines:
                e.engines[node] = url
            for key in ("sk-alpha", "sk-trusted"):
                for _ in range(50):
                    n = len(seen)
                    status, _, _ = await e.call(
                        "POST", "/v1/completions", completion(priority=-100), bearer(key)
                    )
                    if len(seen) > n:
                        break
                    await asyncio.sleep(0.05)  # (the heartbeats have not moved to the fake yet)
                assert status == 200
    finally:
        await runner.cleanup()
    alpha, trusted = seen[0], seen[-1]
    assert "priority" not in alpha
    assert trusted["priority"] == -100
