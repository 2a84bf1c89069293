"""Draining a node over kvgate.control: every router (also one started later) stops sending it
new requests, the requests it is serving finish, and undraining takes it back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deploy.procs import Supervisor
from streams.schemas import Decision
from streams.settings import KafkaSettings
from streams.topics import DECISIONS
from tests.conftest import wait_until
from tests.integration.cluster import (
    MODEL,
    Cluster,
    get,
    kvgate_cli,
    long_prompt,
    post,
    read_topic,
)

pytestmark = pytest.mark.integration


def kvgate(supervisor: Supervisor, *argv: str) -> None:
    done = kvgate_cli(supervisor, *argv)
    assert done.returncode == 0, done.stderr


async def candidates(url: str, prompt: str) -> set[str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    _, d = await post(url, "/v1/kvgate/decide", body)
    return {c["node_id"] for c in d["candidates"]}


async def test_drain_and_undrain(supervisor: Supervisor, kafka_settings: KafkaSettings) -> None:
    cluster, url = await Cluster.two_nodes(supervisor)
    prompt = long_prompt("drain", 200)
    assert await candidates(url, prompt) == {"n1", "n2"}
    # a long stream, and the node serving it drained while it runs: it still finishes
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "stream": True}
    running = asyncio.create_task(post(url, "/v1/completions", body, {"X-Request-Id": "long"}))
    decisions = await read_topic(
        kafka_settings,
        DECISIONS,
        Decision,
        lambda ds: any(d.client_request_id == "long" for d in ds),
    )
    busy = next(d.chosen_node for d in decisions if d.client_request_id == "long")
    assert busy in ("n1", "n2") and not running.done()
    other = ({"n1", "n2"} - {busy}).pop()
    kvgate(supervisor, "drain", busy)

    async def drained() -> bool:
        return (await get(url, "/v1/kvgate/state"))["drained"] == [busy]

    await wait_until(drained, 20, f"the router to see {busy} drained", 0.2)
    assert await candidates(url, prompt) == {other}
    status, text = await running
    assert status == 200 and "[DONE]" in text
    # a router started now reads the drain from the compacted topic before it serves
    late = cluster.add_router("router-late")
    await cluster.wait_ready("router-late", 1)

    async def late_drained() -> bool:
        return (await get(late, "/v1/kvgate/state"))["drained"] == [busy]

    await wait_until(late_drained, 20, "the late router to see the drain", 0.2)
    assert await candidates(late, prompt) == {other}
    kvgate(supervisor, "undrain", busy)

    async def back() -> bool:
        return await candidates(url, prompt) == {"n1", "n2"}

    await wait_until(back, 20, "n1 back in routing", 0.2)


async def test_canary_group_takes_its_share(supervisor: Supervisor) -> None:
    _, url = await Cluster.two_nodes(supervisor)
    kvgate(supervisor, "canary", "v2", "--nodes", "n2", "--share", "0.25")

    async def applied() -> bool:
        state = await get(url, "/v1/kvgate/state")
        return state["canaries"] == {"v2": {"nodes": ["n2"], "share": 0.25}}

    await wait_until(applied, 20, "the router to apply the canary", 0.2)
    seen = [await candidates(url, long_prompt(f"canary {i}", 40)) for i in range(120)]
    # each request falls on one side: the canary alone, or everything but the canary
    assert all(c in ({"n2"}, {"n1"}) for c in seen)
    share = sum(c == {"n2"} for c in seen) / len(seen)
    assert 0.1 < share < 0.4, share  # 0.25 ± 3.8 standard deviations
    kvgate(supervisor, "canary", "v2", "--off")

    async def ended() -> bool:
        return (await get(url, "/v1/kvgate/state"))["canaries"] == {}

    await wait_until(ended, 20, "the canary to end", 0.2)
    assert await candidates(url, long_prompt("after", 40)) == {"n1", "n2"}
