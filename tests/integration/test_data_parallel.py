"""An engine with data-parallel ranks (vLLM's --data-parallel-size): one HTTP server, one KV
cache per engine core, each core's KV events on the endpoint's port + rank and its metrics under
its ``engine`` label. Each rank is a node of its own; the router pins a request to the rank it
chose (``X-data-parallel-rank``), so the hits it claims are the ones that core has."""

from __future__ import annotations

from typing import Any

import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, long_prompt, post

pytestmark = pytest.mark.integration


async def test_each_rank_is_a_node_and_requests_stay_on_their_rank(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    supervisor.env["KVGATE_AGENT__DATA_PARALLEL_SIZE"] = "2"
    c = Cluster(supervisor)
    c.add_engine("n1", engine_env={"KVGATE_ENGINE__DATA_PARALLEL_SIZE": "2"})
    c.add_worker()
    url = c.add_router()
    await c.wait_ready("router", 2)
    ranks = ("n1-dp0", "n1-dp1")

    def body(i: int) -> dict[str, Any]:
        return {"model": MODEL, "prompt": long_prompt(f"dp-{i}", 240), "max_tokens": 2}

    async def held_by(i: int) -> set[str]:
        _, d = await post(url, "/v1/kvgate/decide", body(i))
        return {c["node_id"] for c in d["candidates"] if c["hit_blocks"] == d["prompt_blocks"]}

    homes: dict[int, str] = {}
    for i in range(12):  # until both ranks have computed prompts of their own
        status, out = await post(url, "/v1/completions", body(i))
        assert status == 200, out
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        async def indexed(i: int = i) -> set[str] | None:
            held = await held_by(i)
            return held or None

        held = await wait_until(indexed, 15, f"prompt {i} in the index", 0.1)
        assert len(held) == 1 and held <= set(ranks), held  # on the rank that computed it only
        homes[i] = next(iter(held))
        if set(homes.values()) == set(ranks):
            break
    assert set(homes.values()) == set(ranks), homes
    for i, home in homes.items():  # served again: the router claims the hit, the core has it
        status, out = await post(url, "/v1/completions", body(i))
        assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, home
    # a gateway that forwards itself gets the header with the route, and the engine honours it
    home_of_1 = next(i for i, home in homes.items() if home == "n1-dp1")
    status, routed = await post(url, "/v1/kvgate/route", body(home_of_1))
    assert status == 200, routed
    assert routed["node_id"] == "n1-dp1"
    assert routed["headers"] == {"X-data-parallel-rank": "1"}
    status, out = await post(routed["endpoint"], routed["path"], body(home_of_1), routed["headers"])
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    status, _ = await post(
        url, "/v1/kvgate/release", {"reservation_id": routed["reservation_id"], "output_tokens": 2}
    )
    assert status == 200
