"""SLO classes on a live cluster: while an engine is busy prefilling long prompts, a batch-class
request waits in the router (held) instead of queueing behind them, and goes once the queue
has drained; an interactive-class request is not held. Every request finishes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.integration.cluster import MODEL, Cluster, metric, post

pytestmark = pytest.mark.integration

TENANTS = (
    '{"sk-batch": {"name": "nightly", "slo_class": "batch"},'
    ' "sk-chat": {"name": "chat", "priority": "high", "slo_class": "interactive"}}'
)


async def test_batch_is_held_while_the_engine_is_queued_and_interactive_is_not(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    c.add_engine("n1", num_gpu_blocks=4000)
    c.add_worker()
    url = c.add_router("router", env={"KVGATE_ADMISSION__TENANTS": TENANTS})
    await c.wait_ready("router", 1)

    def body(i: int, words: int) -> dict[str, Any]:
        return {"model": MODEL, "prompt": f"job {i} " + "word " * words, "max_tokens": 4}

    chat = {"Authorization": "Bearer sk-chat"}
    # long prompts from the interactive tenant: several seconds of prefill queued at once
    busy = [
        asyncio.create_task(post(url, "/v1/completions", body(i, 8_000), chat)) for i in range(4)
    ]
    await asyncio.sleep(0.2)
    assert await metric(url, "kvgate_router_holds_total") == 0
    batch = asyncio.create_task(
        post(url, "/v1/completions", body(99, 200), {"Authorization": "Bearer sk-batch"})
    )
    await asyncio.sleep(0.3)
    assert await metric(url, "kvgate_router_held_requests") == 1
    assert not batch.done()
    for task in [*busy, batch]:
        status, out = await task
        assert status == 200, out
    assert await metric(url, "kvgate_router_holds_total") == 1
    assert await metric(url, "kvgate_router_held_requests") == 0
    met = 'kvgate_router_slo_requests_total{outcome="met",slo_class="batch"}'
    assert await metric(url, met) == 1
