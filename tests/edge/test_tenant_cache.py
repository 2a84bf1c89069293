"""Tenants' caches apart by default: every request of an API-key tenant reaches the engine with
the ``cache_salt`` of its tenant's cache group, whatever salt the client sent, so the engine (which
keys its cache by the salt, as vLLM and SGLang do) never gives one tenant a hit on another's
prompt. Tenants of one ``cache_group`` share; ``router.cache_isolation = "off"`` passes clients'
salts through."""

from __future__ import annotations

from typing import Any

from admission.settings import Tenant
from router.flow.salt import tenant_salt
from tests.edgekit import GATEWAY, TENANTS, bearer, completion, edge, recording_engine

SHARING = {
    **TENANTS,
    "sk-c": Tenant(name="c", cache_group="partners"),
    "sk-d": Tenant(name="d", cache_group="partners"),
}
PROMPT = "a long confidential system prompt of one tenant " * 40


async def test_an_engine_gives_no_tenant_a_hit_on_another_tenants_prompt() -> None:
    async with edge(engines=1, admission={"tenants": SHARING}) as e:

        async def cached(key: str, **extra: Any) -> int:
            status, out, _ = await e.call(
                "POST", "/v1/completions", completion(PROMPT, **extra), bearer(key)
            )
            assert status == 200, out
            return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert await cached("sk-alpha") == 0
        assert await cached("sk-alpha") > 300  # its own prefix
        assert await cached("sk-beta") == 0  # the same prompt, another tenant
        assert await cached("sk-beta", cache_salt=tenant_salt("alpha")) == 0  # no forging
        assert await cached("sk-alpha", cache_salt="mine") == 0  # a salt of its own: its own
        assert await cached("sk-c") == 0
        assert await cached("sk-d") > 300  # a sharing group


async def test_the_salt_reaches_the_engine_and_the_gateway() -> None:
    async with recording_engine() as (url, seen), edge(admission={"tenants": SHARING}) as e:
        for node in e.engines:
            e.engines[node] = url
        for key in ("sk-alpha", "sk-beta", "sk-c", "sk-d"):
            n = len(seen.bodies)
            for _ in range(50):  # (until the heartbeats have moved to the stand-in)
                status, _, _ = await e.call(
                    "POST", "/v1/completions", completion(cache_salt="x"), bearer(key)
                )
                assert status == 200
                if len(seen.bodies) > n:
                    break
        salts = [b["cache_salt"] for b in seen.bodies[-4:]]
        assert salts == [
            tenant_salt("alpha", "x"),
            tenant_salt("beta", "x"),
            tenant_salt("partners", "x"),
            tenant_salt("partners", "x"),
        ]
        status, out, _ = await e.call(
            "POST",
            "/v1/kvgate/route",
            completion(),
            {**bearer("sk-alpha"), "X-Kvgate-Gateway-Key": GATEWAY},
        )
        assert status == 200, out
        assert out["cache_salt"] == tenant_salt("alpha")  # the gateway sets it in its body


async def test_isolation_off_passes_the_clients_salt() -> None:
    off = {"cache_isolation": "off"}
    async with recording_engine() as (url, seen), edge(router=off) as e:
        for node in e.engines:
            e.engines[node] = url
        for _ in range(50):
            status, _, _ = await e.call(
                "POST", "/v1/completions", completion(cache_salt="x"), bearer("sk-alpha")
            )
            assert status == 200
            if seen.bodies:
                break
        assert seen.bodies[-1]["cache_salt"] == "x"
