"""An engine that looks like SGLang (its metric names, no KV events): the agent reports it, and
the router routes to it on an approximate index built from its own decisions, marked so in the
decision records."""

from __future__ import annotations

from typing import Any

import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.integration.cluster import MODEL, Cluster, decision_of, get, long_prompt, post

pytestmark = pytest.mark.integration


async def test_sglang_node_routes_on_an_approximate_index(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    _c, router = await Cluster.started(supervisor, {"s1": {"sglang": True}})
    state: dict[str, Any] = await get(router, "/v1/kvgate/state")
    node = state["nodes"]["s1"]
    assert node["healthy"] and node["model"] == MODEL and node["kv_used_ratio"] < 1.0

    body = {"model": MODEL, "prompt": long_prompt("sglang"), "max_tokens": 4}
    status, _ = await post(router, "/v1/completions", body, {"X-Request-Id": "sg-1"})
    assert status == 200
    _, d = await post(router, "/v1/kvgate/decide", body)
    hit = {c["node_id"]: c["hit_blocks"] for c in d["candidates"]}
    assert hit["s1"] == d["prompt_blocks"] > 0  # from the router's own decision
    assert (await get(router, "/v1/kvgate/state"))["nodes"]["s1"]["indexed_blocks"] == 0

    status, _ = await post(router, "/v1/completions", body, {"X-Request-Id": "sg-2"})
    assert status == 200
    second = await decision_of(kafka_settings, "sg-2")
    cand = next(x for x in second.candidates if x.node_id == "s1")
    assert cand.approximate_index and cand.hit_blocks > 0
