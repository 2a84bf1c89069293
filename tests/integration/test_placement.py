"""Placement constraints on a live cluster: agents label their nodes, a router in zone a keeps
its requests there, a request can require a GPU type (and gets a 503 when no node has it), a
tenant's required labels always hold, and a malformed label header is a 400."""

from __future__ import annotations

from collections import Counter

import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.integration.cluster import MODEL, Cluster, get, long_prompt, post

pytestmark = pytest.mark.integration

NODES = {"a1": ("a", "h100"), "a2": ("a", "l40s"), "b1": ("b", "h100")}
TENANTS = '{"sk-gold": {"name": "gold", "require_labels": {"gpu": "l40s"}}}'


async def test_zone_preference_required_labels_and_tenant_labels(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    for node, (zone, gpu) in NODES.items():
        c.add_engine(
            node, agent_env={"KVGATE_AGENT__LABELS": f'{{"zone": "{zone}", "gpu": "{gpu}"}}'}
        )
    c.add_worker()
    url = c.add_router(
        "router", env={"KVGATE_ROUTER__ZONE": "a", "KVGATE_ADMISSION__TENANTS": TENANTS}
    )
    await c.wait_ready("router", 3)
    state = await get(url, "/v1/kvgate/state")
    assert {n for n in state["nodes"]} == set(NODES)

    async def route(i: int, headers: dict[str, str] | None = None) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": long_prompt(f"placement {i}", 40), "max_tokens": 2}
        status, out = await post(url, "/v1/kvgate/route", body, headers)
        if status == 200:
            await post(url, "/v1/kvgate/release", {"reservation_id": out["reservation_id"]})
            return status, out["node_id"]
        return status, out["error"]["message"]

    zone_a = Counter([(await route(i))[1] for i in range(20)])
    assert set(zone_a) <= {"a1", "a2"}, zone_a  # the router's own zone while it has room
    h100 = Counter(
        [(await route(i, {"X-Kvgate-Require-Labels": "gpu=h100"}))[1] for i in range(10)]
    )
    assert set(h100) == {"a1"}, h100  # required gpu, preferred zone
    cross = await route(0, {"X-Kvgate-Require-Labels": "gpu=h100,zone=b"})
    assert cross == (200, "b1")
    status, msg = await route(0, {"X-Kvgate-Require-Labels": "gpu=b200"})
    assert status == 503 and "gpu=b200" in msg
    status, msg = await route(0, {"X-Kvgate-Require-Labels": "gpu"})
    assert status == 400 and "key=value" in msg
    gold = {"Authorization": "Bearer sk-gold", "X-Kvgate-Require-Labels": "zone=a"}
    assert Counter([(await route(i, gold))[1] for i in range(5)]) == {"a2": 5}
