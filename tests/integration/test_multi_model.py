"""Several models behind one router: requests go only to nodes serving their model, an unknown
model is a 404, /v1/models lists what is served, and the router's /metrics tell its state."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.integration.cluster import Cluster, get, post

pytestmark = pytest.mark.integration


async def test_requests_route_only_to_nodes_serving_their_model(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    engines = {"a1": "model-a", "a2": "model-a", "b1": "model-b"}
    _c, router = await Cluster.started(supervisor, {n: {"model": m} for n, m in engines.items()})
    models = await get(router, "/v1/models")
    assert sorted(m["id"] for m in models["data"]) == ["model-a", "model-b"]
    served: dict[str, set[str]] = {"model-a": set(), "model-b": set()}
    async with aiohttp.ClientSession() as http:
        for i in range(16):
            model = "model-a" if i % 2 else "model-b"
            body = {"model": model, "prompt": f"question {i} " * 20, "max_tokens": 2}
            async with http.post(router + "/v1/completions", json=body) as r:
                assert r.status == 200
                served[model].add(r.headers["X-Kvgate-Node"])
    assert served["model-b"] == {"b1"}
    assert served["model-a"] <= {"a1", "a2"} and served["model-a"]
    status, err = await post(router, "/v1/completions", {"model": "model-c", "prompt": "x"})
    assert status == 404 and "model-c" in err["error"]["message"]

    async with aiohttp.ClientSession() as http, http.get(router + "/metrics") as r:
        text = await r.text()
    for name in (
        "kvgate_router_decisions_total",
        "kvgate_router_decision_seconds_bucket",
        "kvgate_router_rejections_total",
        "kvgate_router_replica_lag_seconds",
        "kvgate_router_index_gap_batches",
        'kvgate_router_nodes{state="healthy"} 3.0',
    ):
        assert name in text, name
    lag = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kvgate_router_replica_lag_seconds ")
    )
    assert 0 <= lag < 5


async def test_one_models_reservations_never_refuse_another_model(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    """Budgets are per (pool, model): model-a saturated up to its red watermark is refused,
    while model-b, idle in the same pool, is admitted."""
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    c.add_engine("a1", num_gpu_blocks=300, model="model-a")
    c.add_engine("b1", num_gpu_blocks=300, model="model-b")
    c.add_worker()
    url = c.add_router("router", env={"KVGATE_ADMISSION__QUEUE_ENABLED": "false"})
    await c.wait_ready("router", 2)

    def body(model: str, i: int) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": f"request {i} " + "word " * 480,
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }

    running: list[asyncio.Task[tuple[int, Any]]] = []
    refused: tuple[int, Any] | None = None
    for i in range(6):  # long streams of model-a until its budget refuses one
        task = asyncio.create_task(post(url, "/v1/completions", body("model-a", i)))
        await asyncio.sleep(0.3)
        if task.done() and task.result()[0] == 429:
            refused = task.result()
            break
        running.append(task)
    assert refused is not None and running, "model-a was never refused"
    status, err = refused
    assert err["error"]["kvgate_reason"] == "red_watermark"
    state = await get(url, "/v1/kvgate/state")
    a, b = state["budgets"]["default:model-a"], state["budgets"]["default:model-b"]
    assert a["reserved_kv_blocks"] > 0.5 * a["kv_blocks_total"]
    assert b["reserved_kv_blocks"] == 0 and b["kv_blocks_total"] == 300
    # the idle model is admitted, with the same request shape
    status, text = await post(url, "/v1/completions", body("model-b", 99))
    assert status == 200 and "[DONE]" in text
    for task in running:
        status, text = await task
        assert status == 200 and "[DONE]" in text
