"""Prefill/decode disaggregation on a live cluster, through vLLM's KV-connector protocol as the
simulated engines speak it: a prefill node computes the prompt (one token, KV kept for a remote
decode), the decode node receives that KV (its usage reports the prompt as cached) and streams
the answer; the decision names both nodes; a second reservation covers the prefill while it
runs and nothing stays reserved. When the prefill leg fails, the decode node computes the
prompt itself and the client still gets its answer."""

from __future__ import annotations

import aiohttp
import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.schemas import Decision
from streams.settings import KafkaSettings
from streams.topics import DECISIONS
from tests.conftest import wait_until
from tests.integration.cluster import (
    Cluster,
    get,
    long_prompt,
    metric,
    read_topic,
    streamed_completion,
)

pytestmark = pytest.mark.integration

CONNECTOR = {"KVGATE_ENGINE__KV_TRANSFER": "true"}


async def test_prefill_on_one_node_decode_on_another(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    prefill = c.add_engine("p1", engine_env=CONNECTOR, agent_env={"KVGATE_AGENT__ROLE": "prefill"})
    c.add_engine("d1", engine_env=CONNECTOR, agent_env={"KVGATE_AGENT__ROLE": "decode"})
    c.add_worker()
    url = c.add_router("router")
    await c.wait_ready("router", 2)
    prompt = long_prompt("disaggregated", 600)

    node, usage = await streamed_completion(url, prompt, "pd-1")
    assert node == "d1"
    prompt_tokens = usage["prompt_tokens"]
    # the decode node computed only the last, partial block: the rest arrived from p1
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= prompt_tokens - 2 * 16, usage
    assert await metric(prefill, "vllm:prompt_tokens_total") >= prompt_tokens
    assert await metric(url, 'kvgate_router_disaggregated_total{outcome="ok"}') == 1
    decisions = await read_topic(
        kafka_settings,
        DECISIONS,
        Decision,
        lambda ds: any(d.client_request_id == "pd-1" for d in ds),
    )
    d = next(d for d in decisions if d.client_request_id == "pd-1")
    assert (d.chosen_node, d.prefill_node, d.reason) == ("d1", "p1", "disaggregated")

    # the prefill leg fails: the decode node computes the prompt, the client notices nothing
    async with aiohttp.ClientSession() as http:
        async with http.post(prefill + "/kvgate/fault", json={"fault": "error"}) as r:
            assert r.status == 200
    node, usage = await streamed_completion(url, long_prompt("fallback", 600), "pd-2")
    assert node == "d1" and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert await metric(url, 'kvgate_router_disaggregated_total{outcome="fallback"}') == 1

    async def released() -> bool:
        s = await get(url, "/v1/kvgate/state")
        return bool(s["reservations"] == 0 and s["inflight"] == 0)

    await wait_until(released, 20, "every reservation (decode and prefill) released", 0.2)
