"""Admission across a Redis failover (real Redis, real Sentinel, real Kafka, two routers).

The primary of a Sentinel-managed Redis is killed -9 while four long requests hold
reservations in it. Both routers go on admitting at once, each within its share of the budget
(``/ready`` stays 200 and says ``local_share``; the decision records say ``local_share``).
Once the Sentinel has promoted the replica, the routers find the new primary, tell it what
they admitted and released meanwhile, and admit through it again. When every request has
ended, the new primary and the ledger hold nothing: no reservation leaked, none was expired
by compensation, every reserve has its release."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.schemas import Decision, LedgerEvent
from streams.settings import KafkaSettings, WorkerSettings
from streams.topics import DECISIONS, LEDGER
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, ledger_open, post, read_topic
from tests.sentinelset import SentinelSet

pytestmark = [pytest.mark.integration, pytest.mark.fault]


async def _ready(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(url + "/ready") as r:
        return r.status, await r.json()


async def _stream(url: str, words: int) -> int:
    body = {"model": MODEL, "prompt": "go on " * words, "max_tokens": 4000, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as r:
        async for _ in r.content:
            pass
        return r.status


async def test_a_sentinel_failover_keeps_admitting_and_leaks_nothing(
    supervisor: Supervisor,
    kafka_settings: KafkaSettings,
    worker_settings: WorkerSettings,
    tmp_path: Path,
) -> None:
    await ensure_topics(kafka_settings)
    redis = SentinelSet(supervisor, tmp_path / "sentinel")
    await asyncio.to_thread(redis.start)
    supervisor.env.update(
        {
            **redis.env(),
            "KVGATE_ADMISSION__BACKEND": "redis",
            "KVGATE_ADMISSION__STORE_DOWN_SHARE": "0.5",
            "KVGATE_ADMISSION__SWEEP_INTERVAL_S": "1",
            "KVGATE_ADMISSION__RECONCILE_INTERVAL_S": "0.5",
            "KVGATE_ADMISSION__RECONCILE_GRACE_S": "3",
        }
    )
    c = Cluster(supervisor)
    c.add_engine("n1")
    c.add_worker()
    a, b = c.add_router("router-a"), c.add_router("router-b")
    await c.wait_ready("router-a", 1)
    await c.wait_ready("router-b", 1)

    def held() -> int:
        with redis.client() as r:
            return int(r.hlen(f"kvgate:{kafka_settings.namespace}:resv"))

    async def four_held() -> bool:
        return await asyncio.to_thread(held) == 4

    calls = [asyncio.create_task(_stream(a, 30 + i)) for i in range(4)]
    try:
        await wait_until(four_held, 20, "four reservations in the primary")
        redis.kill_primary()
        # no primary: both routers admit at once, on their share
        for i in range(6):
            status, _ = await post(
                (a, b)[i % 2],
                "/v1/completions",
                {"model": MODEL, "prompt": f"q{i}", "max_tokens": 4},
            )
            assert status == 200, i
        for url in (a, b):
            status, body = await _ready(url)
            assert status == 200 and body["admission_store"] == "local_share", body
        assert await asyncio.to_thread(redis.wait_failover) < 15

        async def shared_again() -> bool:
            states = [(await _ready(u))[1]["admission_store"] for u in (a, b)]
            return states == ["shared", "shared"]

        await wait_until(shared_again, 15, "both routers to admit through the new primary", 0.25)
        await wait_until(four_held, 10, "the new primary to hold the four in flight")
        assert all(not t.done() for t in calls)  # served all along
        status, _ = await post(
            b, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4}
        )
        assert status == 200
    finally:
        for t in calls:
            t.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    async def released() -> bool:
        return held() == 0 and await ledger_open(a, b) == 0

    await wait_until(released, 20, "every reservation released", 0.25)
    events = await read_topic(kafka_settings, LEDGER, LedgerEvent, lambda evs: len(evs) >= 22)
    kinds = [e.kind for e in events]
    assert kinds.count("reserve") == kinds.count("release") == 11, kinds
    assert "expire" not in kinds
    decisions = await read_topic(kafka_settings, DECISIONS, Decision, lambda ds: len(ds) >= 11)
    reasons = [d.admission_reason for d in decisions]
    assert reasons.count("local_share") == 6, reasons
    assert reasons.count("ok") == 5, reasons
