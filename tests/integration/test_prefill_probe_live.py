"""The engines' prefill rate reaches the routers before the first request: each agent measures
its idle engine when it starts (agents/probe.py), the heartbeat carries the figure through Kafka
and the worker's load table, and the router prices a miss with it (the mean over a model's
nodes) instead of its configured 25,000 tokens/s."""

from __future__ import annotations

import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.conftest import wait_until
from tests.integration.cluster import Cluster, get

pytestmark = pytest.mark.integration

SLOW = {"KVGATE_ENGINE__PROFILE__PREFILL_TOKENS_PER_S": "2000"}


async def test_the_router_knows_each_engines_prefill_rate_before_any_request(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    engines = {
        "s1": {"engine_env": SLOW},
        "s2": {"engine_env": SLOW},
        # another model whose agent does not probe: the router knows nothing of its rate
        "q1": {"model": "other", "agent_env": {"KVGATE_AGENT__PREFILL_PROBE": "false"}},
    }
    _c, router = await Cluster.started(supervisor, engines)

    async def reported() -> bool:
        nodes = (await get(router, "/v1/kvgate/state"))["nodes"]
        return all(nodes.get(n, {}).get("reported_prefill_tokens_per_s") for n in ("s1", "s2"))

    await wait_until(reported, 30.0, "both slow engines' rates at the router", 0.25)
    state = await get(router, "/v1/kvgate/state")
    assert state["inflight"] == 0  # nothing has been routed: no first token taught it
    nodes = state["nodes"]
    for n in ("s1", "s2"):
        assert 1700 <= nodes[n]["reported_prefill_tokens_per_s"] <= 2100, nodes[n]
        assert nodes[n]["observed_prefill_tokens_per_s"] is None
    mean = (
        nodes["s1"]["reported_prefill_tokens_per_s"] + nodes["s2"]["reported_prefill_tokens_per_s"]
    ) / 2
    assert nodes["s1"]["prefill_tokens_per_s"] == nodes["s2"]["prefill_tokens_per_s"]
    assert nodes["s1"]["prefill_tokens_per_s"] == pytest.approx(mean, abs=0.1)
    assert nodes["q1"]["reported_prefill_tokens_per_s"] is None
    assert nodes["q1"]["prefill_tokens_per_s"] is None  # priced at cost.prefill_tokens_per_s
