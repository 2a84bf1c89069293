"""Several models behind one router: requests go only to nodes serving their model, an unknown
model is a 404, /v1/models lists what is served, and the router's /metrics tell its state."""

from __future__ import annotations

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
