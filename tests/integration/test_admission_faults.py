"""Kill -9 a router holding reservations (Redis store): the leases expire, another router writes
the compensation events, and the ledger returns to zero."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from deploy.procs import Supervisor
from streams.codec import decode
from streams.kafka import ensure_topics, make_consumer
from streams.schemas import LedgerEvent
from streams.settings import KafkaSettings
from streams.topics import LEDGER
from tests.conftest import REDIS, wait_until
from tests.integration.cluster import MODEL, Cluster, get

pytestmark = [pytest.mark.integration, pytest.mark.fault]


async def test_killed_router_leases_expire_with_compensation_events(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    supervisor.env.update(
        {
            "KVGATE_ADMISSION__BACKEND": "redis",
            "KVGATE_REDIS__URL": REDIS,
            "KVGATE_ADMISSION__LEASE_S": "4",
            "KVGATE_ADMISSION__SWEEP_INTERVAL_S": "0.5",
        }
    )
    c = Cluster(supervisor)
    c.add_engine("n1")
    c.add_worker()
    doomed = c.add_router("router-a")
    survivor = c.add_router("router-b")
    await c.wait_ready("router-a", 1)
    await c.wait_ready("router-b", 1)

    async def long_call(http: aiohttp.ClientSession) -> None:
        try:
            async with http.post(
                doomed + "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "a long answer please " * 20,
                    "max_tokens": 5000,
                    "stream": True,
                },
            ) as r:
                async for _ in r.content:
                    pass
        except aiohttp.ClientError:
            pass

    async with aiohttp.ClientSession() as http:
        calls = [asyncio.create_task(long_call(http)) for _ in range(5)]

        async def held() -> bool:
            return (await get(survivor, "/v1/kvgate/state"))["reservations"] == 5

        await wait_until(held, 10, "five reservations visible to the other router")
        supervisor.kill("router-a", signal.SIGKILL)
        await asyncio.gather(*calls)

    async def expired() -> bool:
        s = await get(survivor, "/v1/kvgate/state")
        return s["reservations"] == 0 and s["reserved_kv_blocks"] == 0

    await wait_until(expired, 15, "the dead router's leases to expire", 0.25)

    consumer = make_consumer(
        kafka_settings, LEDGER.name(kafka_settings.namespace), group_id=None, client_id="t-ledger"
    )
    await consumer.start()
    events: list[LedgerEvent] = []
    try:
        for _ in range(50):
            for records in (await consumer.getmany(timeout_ms=200)).values():
                events += [decode(LedgerEvent, r.value) for r in records]
            if sum(e.kind == "expire" for e in events) >= 5:
                break
    finally:
        await consumer.stop()
    reserved = sum(e.kv_blocks for e in events if e.kind == "reserve")
    undone = sum(e.kv_blocks for e in events if e.kind in ("release", "expire"))
    assert sum(e.kind == "reserve" for e in events) == 5
    assert sum(e.kind == "expire" for e in events) == 5
    assert {e.router_id for e in events if e.kind == "expire"} == {"router-b"}
    assert reserved == undone  # the ledger is back to zero
