"""Engines started with an API key (vLLM ``--api-key``): the router sends
``router.upstream_api_key``; without it the engine refuses and the client gets a 502 naming
the node, never the key."""

from __future__ import annotations

from tests.edgekit import bearer, completion, edge

KEY = "engine-secret-0123"


async def test_the_router_authenticates_to_engines_that_want_a_key() -> None:
    async with edge(engine={"api_key": KEY}, router={"upstream_api_key": KEY}) as e:
        status, body, _ = await e.call("POST", "/v1/completions", completion(), bearer("sk-alpha"))
        assert status == 200, body
        status, body, _ = await e.call(
            "POST", "/v1/completions", completion(stream=True), bearer("sk-alpha")
        )
        assert status == 200
    async with edge(engine={"api_key": KEY}) as e:
        status, body, _ = await e.call("POST", "/v1/completions", completion(), bearer("sk-alpha"))
        assert status == 502 and "credentials" in body["error"]["message"], body
        assert KEY not in str(body)
