"""LoRA adapters and ``cache_salt`` end to end: the engine hashes an adapter into every block and
a salt into the first (as vLLM does, and says so in its KV events); the agent indexes those
blocks under the same roots as the router hashes such requests. So a request for an adapter never
counts the base model's blocks, salted tenants never share hits, and the hits the router does
claim are hits the engine really has (its ``cached_tokens``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, get, long_prompt, post

pytestmark = pytest.mark.integration

ADAPTERS = ["sql=/adapters/sql", "chat=/adapters/chat"]


async def test_adapters_and_salts_claim_only_the_hits_the_engine_has(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    c.add_engine("n1", engine_env={"KVGATE_ENGINE__LORA_MODULES": json.dumps(ADAPTERS)})
    c.add_worker()
    url = c.add_router()
    await c.wait_ready("router", 1)

    async def adapters_listed() -> bool:
        listing = await get(url, "/v1/models")
        parents = {m["id"]: m.get("parent") for m in listing["data"]}
        return parents.get("sql") == MODEL and parents.get("chat") == MODEL

    await wait_until(adapters_listed, 30, "the router to list the engine's adapters", 0.25)
    prompt = long_prompt("lora-and-salt", 300)

    def body(**extra: Any) -> dict[str, Any]:
        return {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}

    async def hits(**extra: Any) -> tuple[int, int]:
        _, d = await post(url, "/v1/kvgate/decide", body(**extra))
        got = {c["node_id"]: c["hit_blocks"] for c in d["candidates"]}
        return got.get("n1", 0), d["prompt_blocks"]

    async def run(**extra: Any) -> int:
        """Serve the request; the prompt tokens the engine found in its cache."""
        status, out = await post(url, "/v1/completions", body(**extra))
        assert status == 200, out
        return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def indexed(**extra: Any) -> bool:
        hit, blocks = await hits(**extra)
        return blocks > 10 and hit == blocks

    # the base model computes the prompt: indexed for base requests only
    assert await run() == 0
    await wait_until(lambda: indexed(), 15, "the base model's blocks in the index", 0.1)
    for other in ({"model": "sql"}, {"cache_salt": "tenant-1"}):
        assert (await hits(**other))[0] == 0, other
        assert await run(**other) == 0, other  # and the engine has no hit for it either
    # each of those is now cached under its own root, and hits only for its own kind
    await wait_until(lambda: indexed(model="sql"), 15, "the adapter's blocks", 0.1)
    await wait_until(lambda: indexed(cache_salt="tenant-1"), 15, "the salted blocks", 0.1)
    assert (await hits(model="chat"))[0] == 0
    assert (await hits(cache_salt="tenant-2"))[0] == 0
    assert (await hits(model="sql", cache_salt="tenant-1"))[0] == 0
    # what the router claims, the engine has
    _, blocks = await hits(model="sql")
    assert await run(model="sql") >= blocks * 16 - 16
    assert await run(cache_salt="tenant-1") >= blocks * 16 - 16
    status, out = await post(url, "/v1/completions", body(model="no-such-adapter"))
    assert status == 404, out
