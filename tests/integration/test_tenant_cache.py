"""Tenants' caches kept apart by default: with API-key tenants configured, every request carries a
``cache_salt`` derived from its tenant's cache group, so a tenant replaying another tenant's
prompt finds nothing in the engine's cache (its ``cached_tokens`` and its latency tell it
nothing), while tenants of one sharing group hit each other's prefixes. The router's index, its
dry run and pre-warming keep tenants apart exactly as the engine does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deploy.procs import Supervisor
from router.flow.salt import tenant_salt
from streams.kafka import ensure_topics
from streams.schemas import ControlMessage
from streams.settings import KafkaSettings
from streams.topics import CONTROL
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, long_prompt, post, read_topic

pytestmark = pytest.mark.integration

TENANTS = {
    "k-a": {"name": "a"},
    "k-b": {"name": "b"},
    "k-c": {"name": "c", "cache_group": "partners"},
    "k-d": {"name": "d", "cache_group": "partners"},
}


def _with_tenants(supervisor: Supervisor) -> None:
    supervisor.env.update({"KVGATE_ADMISSION__TENANTS": json.dumps(TENANTS)})


async def test_a_tenant_never_hits_another_tenants_prompt(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    _with_tenants(supervisor)
    _, url = await Cluster.started(supervisor, {"n1": {}})
    prompt = long_prompt("tenant-cache", 400)

    async def run(key: str | None, **extra: Any) -> int:
        """Served as ``key``'s tenant: the prompt tokens the engine found in its cache."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
        status, out = await post(url, "/v1/completions", body, headers)
        assert status == 200, out
        return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def hits(tenant: str | None) -> tuple[int, int]:
        path = "/v1/kvgate/decide" + (f"?tenant={tenant}" if tenant else "")
        status, d = await post(url, path, {"model": MODEL, "prompt": prompt})
        assert status == 200, d
        return sum(c["hit_blocks"] for c in d["candidates"]), d["prompt_blocks"]

    assert await run("k-a") == 0
    _, blocks = await hits("a")

    async def indexed() -> bool:
        return (await hits("a"))[0] == blocks

    await wait_until(indexed, 15, "tenant a's prompt in the index", 0.1)
    assert await run("k-a") >= blocks * 16 - 16  # its own prefix: a hit
    # another tenant, an anonymous client, and one sending the salt tenant a's requests carry:
    # nothing cached, and the router claims nothing either
    assert (await hits("b"))[0] == 0 and (await hits(None))[0] == 0
    assert await run("k-b") == 0
    assert await run(None) == 0
    assert await run("k-b", cache_salt=tenant_salt("a")) == 0
    # a sharing group: c computes, d hits
    assert await run("k-c") == 0
    assert await run("k-d") >= blocks * 16 - 16
    status, d = await post(url, "/v1/kvgate/decide?tenant=nobody", {"model": MODEL, "prompt": "x"})
    assert status == 400, d


async def test_a_tenants_hot_prefix_is_prewarmed_with_its_salt(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    _with_tenants(supervisor)
    _, url = await Cluster.two_nodes(supervisor)
    shared = long_prompt("tenant-faq", words=400)
    a = {"Authorization": "Bearer k-a"}

    async def holders(tenant: str) -> dict[str, int]:
        path = f"/v1/kvgate/decide?tenant={tenant}"
        _, d = await post(url, path, {"model": MODEL, "prompt": f"{shared} q99"})
        return {c["node_id"]: c["hit_blocks"] for c in d["candidates"] if c["hit_blocks"] > 0}

    body = {"model": MODEL, "prompt": f"{shared} first", "max_tokens": 2}
    assert (await post(url, "/v1/completions", body, a))[0] == 200
    await wait_until(lambda: holders("a"), 20, "the prefix indexed on one node", 0.1)
    for i in range(30):
        body = {"model": MODEL, "prompt": f"{shared} q{i}", "max_tokens": 2}
        assert (await post(url, "/v1/completions", body, a))[0] == 200
    advice = await read_topic(
        kafka_settings, CONTROL, ControlMessage, lambda got: any(m.kind == "prewarm" for m in got)
    )
    payload = next(m for m in advice if m.kind == "prewarm").payload
    assert payload["cache_salt"] == tenant_salt("a")

    async def both_hold() -> bool:
        held = await holders("a")
        return len(held) == 2 and min(held.values()) >= payload["blocks"]

    await wait_until(both_hold, 30, "both nodes to hold tenant a's hot prefix", 0.25)
    assert await holders("b") == {}  # warmed for tenant a alone
