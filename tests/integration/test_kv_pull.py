"""The cluster as one cache, live (router/decision/pull.py): two simulated engines whose KV
connectors give and take a prefix. n1 holds a prefix and is nearly out of KV (a long request
decodes there), so kvgate sends the next request sharing the prefix to n2 — which loads the
prefix's KV from n1 instead of computing it: n2's usage reports it as cached tokens, its KV
events reach the router's index, and the decision names n1 as the pull's source. When n1's leg
fails or hangs (given up after router.pull_timeout_s), n2 computes what it does not hold and the
client still gets its answer."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.schemas import Decision
from streams.settings import KafkaSettings
from streams.topics import DECISIONS
from tests.conftest import wait_until
from tests.integration.cluster import (
    MODEL,
    Cluster,
    decision_of,
    get,
    metric,
    post,
    read_topic,
    streamed_completion,
)

pytestmark = pytest.mark.integration

CONNECTOR = {"KVGATE_ENGINE__KV_TRANSFER": "true"}
PULLS = {"KVGATE_AGENT__KV_PULL": "true"}
P = list(range(1_000, 2_200))  # 75 blocks of 16 tokens
Q = list(range(3_000, 4_200))  # 75 more
U = list(range(10_000, 12_496))  # 156 more
# one node admits a request that fills it (the long one, before n2 joins)
ROOMY = {
    "KVGATE_ADMISSION__SAFETY_FACTOR": "1.0",
    "KVGATE_ADMISSION__YELLOW_WATERMARK": "0.98",
    "KVGATE_ADMISSION__RED_WATERMARK": "0.99",
}


async def complete(url: str, prompt: list[int], rid: str, max_tokens: int = 8) -> dict[str, Any]:
    """A streamed completion of token ids (exact tokens: their blocks are the engines'); its
    node and usage."""
    node, usage = await streamed_completion(url, prompt, rid, max_tokens)
    return {"node": node, "usage": usage}


async def _n1_full(
    supervisor: Supervisor, kafka_settings: KafkaSettings, name: str, first: tuple[int, ...] = ()
) -> tuple[str, str, asyncio.Task[dict[str, Any]]]:
    """n1 (330 blocks, slow steps) alone with a worker and a router, ``first`` completed
    there, then a long request (P + Q + U, 300 tokens out: 306 to 325 of n1's 330 blocks for
    ~15 s) running on it when n2 joins: n1's URL, the router's, the long request."""
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    n1 = c.add_engine(
        "n1",
        num_gpu_blocks=330,
        engine_env={**CONNECTOR, "KVGATE_ENGINE__PROFILE__STEP_BASE_S": "0.05"},
        agent_env=PULLS,
    )
    c.add_worker()
    url = c.add_router("router", env=ROOMY)
    await c.wait_ready("router", 1)
    if first:
        got = await complete(url, list(first), f"{name}-0")
        assert got["node"] == "n1"
    long = asyncio.create_task(complete(url, P + Q + U, f"{name}-long", max_tokens=300))
    c.add_engine("n2", engine_env=CONNECTOR, agent_env=PULLS)
    await c.wait_ready("router", 2)
    # n1's heartbeats show its KV nearly full; the router smooths what it sees of them over
    # its decisions (dry runs here)
    for _ in range(8):
        await asyncio.sleep(0.25)
        await post(url, "/v1/kvgate/decide", {"model": MODEL, "prompt": [7] * 32})
    assert not long.done()
    return n1, url, long


async def test_a_busy_holder_s_prefix_is_pulled_and_a_failed_pull_is_computed(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    n1, url, long = await _n1_full(supervisor, kafka_settings, "pull", first=tuple(P))

    got = await complete(url, P + list(range(5_000, 5_008)), "pull-1")
    assert got["node"] == "n2"
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P)  # loaded, not computed
    assert await metric(url, 'kvgate_router_kv_pulls_total{outcome="ok"}') == 1
    assert await metric(n1, "vllm:prompt_tokens_total") >= len(P) * 2  # n1 answered the leg

    # n2's KV events reached the index: a dry run finds P's blocks held on n2 too
    async def indexed() -> bool:
        _, d = await post(url, "/v1/kvgate/decide", {"model": MODEL, "prompt": P})
        hits = {c["node_id"]: c["hit_blocks"] for c in d["candidates"]}
        return bool(hits.get("n2", 0) >= len(P) // 16 - 1)

    await wait_until(indexed, 20, "n2's KV events of the pulled prefix in the index", 0.2)

    # n1's leg fails: n2 computes the part it does not hold (Q), the client notices nothing
    async with aiohttp.ClientSession() as http:
        async with http.post(n1 + "/kvgate/fault", json={"fault": "error"}) as r:
            assert r.status == 200
    got = await complete(url, P + Q + list(range(6_000, 6_008)), "pull-2")
    assert got["node"] == "n2"
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P)  # its own copy
    assert await metric(url, 'kvgate_router_kv_pulls_total{outcome="fallback"}') == 1
    # n1 hangs: the leg is given up after router.pull_timeout_s (2 s), not the prefill leg's
    # 60 s; n2 computes the 800 tokens of U it lacks
    async with aiohttp.ClientSession() as http:
        async with http.post(n1 + "/kvgate/fault", json={"fault": "hang"}) as r:
            assert r.status == 200
    got = await complete(url, P + Q + U[:800] + list(range(7_000, 7_008)), "pull-3")
    assert got["node"] == "n2"
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P + Q)
    assert await metric(url, 'kvgate_router_kv_pulls_total{outcome="fallback"}') == 2
    async with aiohttp.ClientSession() as http:
        async with http.post(n1 + "/kvgate/fault", json={"fault": "none"}) as r:
            assert r.status == 200
    await long

    decisions = await read_topic(
        kafka_settings,
        DECISIONS,
        Decision,
        lambda ds: {"pull-1", "pull-2", "pull-3"} <= {d.client_request_id for d in ds},
    )
    by = {d.client_request_id: d for d in decisions}
    assert (by["pull-1"].chosen_node, by["pull-1"].reason) == ("n2", "kv_pull")
    assert (by["pull-1"].pull_node, by["pull-1"].pull_blocks) == ("n1", len(P) // 16)
    assert (by["pull-2"].pull_node, by["pull-2"].pull_blocks) == ("n1", len(P + Q) // 16)
    assert (by["pull-3"].pull_node, by["pull-3"].pull_blocks) == ("n1", len(P + Q) // 16 + 50)

    async def released() -> bool:
        s = await get(url, "/v1/kvgate/state")
        return bool(s["reservations"] == 0 and s["inflight"] == 0)

    await wait_until(released, 20, "every reservation released", 0.2)


async def test_a_holder_without_room_for_the_request_gives_its_prefix(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    """n1 holds a long context (P + Q + U, its long request decoding there) and has no room
    for a request that continues it with 100 new blocks: the fit filter leaves only n2, which
    loads the 306 blocks from n1 — a node too full to run the request still gives what it
    holds — instead of computing them."""
    _, url, long = await _n1_full(supervisor, kafka_settings, "give")

    got = await complete(url, P + Q + U + list(range(20_000, 21_600)), "give-1")
    assert got["node"] == "n2"
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P + Q + U)
    assert await metric(url, 'kvgate_router_kv_pulls_total{outcome="ok"}') == 1
    await long
    d = await decision_of(kafka_settings, "give-1")
    assert (d.chosen_node, d.reason, d.pull_node, d.pull_blocks) == (
        "n2",
        "kv_pull",
        "n1",
        len(P + Q + U) // 16,
    )
