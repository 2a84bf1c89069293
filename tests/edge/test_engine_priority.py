"""The body's ``priority`` is the engine's own priority scheduling (vLLM ``--scheduling-policy
priority``): a tenant that sets it jumps the queue of its engine ahead of every other tenant's
requests, whatever kvgate admitted it at. It reaches the engine only for tenants allowed to set
it (``engine_priority``); kvgate removes it for everyone else."""

from __future__ import annotations

import asyncio

from admission.settings import Tenant
from tests.edgekit import TENANTS, bearer, completion, edge, recording_engine


async def test_the_engine_priority_field_reaches_engines_only_for_tenants_allowed_to_set_it() -> (
    None
):
    tenants = {**TENANTS, "sk-trusted": Tenant(name="trusted", engine_priority=True)}
    async with recording_engine() as (url, seen), edge(admission={"tenants": tenants}) as e:
        for node in e.engines:
            e.engines[node] = url
        for key in ("sk-alpha", "sk-trusted"):
            for _ in range(50):
                n = len(seen.bodies)
                status, _, _ = await e.call(
                    "POST", "/v1/completions", completion(priority=-100), bearer(key)
                )
                if len(seen.bodies) > n:
                    break
                await asyncio.sleep(0.05)  # (the heartbeats have not moved to the stand-in yet)
            assert status == 200
    alpha, trusted = seen.bodies[0], seen.bodies[-1]
    assert "priority" not in alpha
    assert trusted["priority"] == -100
