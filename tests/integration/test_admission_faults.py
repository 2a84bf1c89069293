"""Faults around reservations (Redis store, real Kafka):

* kill -9 a router holding reservations: the leases expire, another router writes the
  compensation events, and the ledger (the topic and the worker's ``kv_ledger`` table) returns to
  zero;
* restart Redis empty: nothing is admitted until the reconciler has restored the in-flight
  reservations from the ledger, and they are released normally afterwards."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any, cast

import aiohttp
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from admission.redis_store import RedisReservations
from admission.reservations import Reservation
from deploy.procs import Supervisor, free_port
from streams.kafka import ensure_topics
from streams.ledger import LedgerReplica
from streams.schemas import LedgerEvent
from streams.settings import KafkaSettings, WorkerSettings
from streams.topics import LEDGER
from tests.conftest import REDIS, wait_until
from tests.integration.cluster import MODEL, Cluster, get, ledger_open, post, read_topic

pytestmark = [pytest.mark.integration, pytest.mark.fault]


async def test_killed_router_leases_expire_with_compensation_events(
    supervisor: Supervisor, kafka_settings: KafkaSettings, worker_settings: WorkerSettings
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
        # the router dies after its reserve events reached the ledger (its outbox is in memory:
        # a kill -9 before that loses them, docs/operations.md "When Kafka stops delivering")
        recorded = await read_topic(
            kafka_settings, LEDGER, LedgerEvent, lambda evs: _count(evs, "reserve") >= 5, 15
        )
        assert _count(recorded, "reserve") == 5
        supervisor.kill("router-a", signal.SIGKILL)
        await asyncio.gather(*calls)

    async def expired() -> bool:
        s = await get(survivor, "/v1/kvgate/state")
        return s["reservations"] == 0 and s["reserved_kv_blocks"] == 0

    await wait_until(expired, 15, "the dead router's leases to expire", 0.25)

    events = await read_topic(
        kafka_settings, LEDGER, LedgerEvent, lambda evs: _count(evs, "expire") >= 5, 10
    )
    reserved = sum(e.kv_blocks for e in events if e.kind == "reserve")
    undone = sum(e.kv_blocks for e in events if e.kind in ("release", "expire"))
    assert _count(events, "reserve") == 5
    assert _count(events, "expire") == 5
    assert {e.router_id for e in events if e.kind == "expire"} == {"router-b"}
    assert reserved == undone  # the ledger is back to zero

    # the worker's KV ledger table folded the same events: nothing is open
    table = LedgerReplica(kafka_settings, worker_settings, "t-ledger-table", follow_input=False)
    await table.start()
    try:
        await wait_until(
            lambda: _true(table.caught_up.is_set() and not table.book.open),
            20,
            "the worker's kv_ledger table to hold no open reservation",
        )
    finally:
        await table.stop()


async def test_a_killed_reconciler_is_replaced_by_a_router_that_follows_the_ledger_then(
    supervisor: Supervisor, kafka_settings: KafkaSettings, worker_settings: WorkerSettings
) -> None:
    """Only the reconciling router follows the ledger; kill -9 it and the other one starts
    following, takes the lease once caught up and reconciles (a reservation in the store that
    the ledger never saw gets its ``reserve`` event from the new reconciler)."""
    await ensure_topics(kafka_settings)
    supervisor.env.update(
        {
            "KVGATE_ADMISSION__BACKEND": "redis",
            "KVGATE_REDIS__URL": REDIS,
            "KVGATE_ADMISSION__RECONCILE_INTERVAL_S": "0.5",
            "KVGATE_ADMISSION__RECONCILE_GRACE_S": "2",
            "KVGATE_ADMISSION__RECONCILE_STANDBY_S": "2",
        }
    )
    c = Cluster(supervisor)
    c.add_engine("n1")
    c.add_worker()
    for name in ("router-a", "router-b"):
        c.add_router(name)
    for name in ("router-a", "router-b"):
        await c.wait_ready(name, 1)
    client = Redis.from_url(REDIS)
    prefix = f"kvgate:{kafka_settings.namespace}"

    async def following() -> dict[str, bool]:
        states = {n: await get(u, "/v1/kvgate/state") for n, u in c.routers.items()}
        return {n: s["reconciler"]["following_ledger"] for n, s in states.items()}

    async def one_follows() -> bool:
        return sorted((await following()).values()) == [False, True]

    try:
        await wait_until(one_follows, 20, "the router not reconciling to stop following", 0.25)
        leader = (await client.get(f"{prefix}:reconciler") or b"").decode()
        assert (await following())[leader], leader
        other = ({"router-a", "router-b"} - {leader}).pop()
        state = await get(c.routers[other], "/v1/kvgate/state")
        assert state["reconciler"]["ledger_open"] is None
        assert state["reconciler"]["routers_seen"] == 2
        supervisor.kill(leader, signal.SIGKILL)

        async def took_over() -> bool:
            return (await client.get(f"{prefix}:reconciler") or b"").decode() == other

        await wait_until(took_over, 30, "the other router to take the reconciler's lease", 0.25)
        state = await get(c.routers[other], "/v1/kvgate/state")
        assert state["reconciler"]["following_ledger"]
        ghost = Reservation("ghost-1", "default:" + MODEL, 3, 1, time.time() + 600)
        assert await RedisReservations(client, prefix).restore(ghost)
        events = await read_topic(
            kafka_settings,
            LEDGER,
            LedgerEvent,
            lambda evs: any(e.reservation_id == "ghost-1" for e in evs),
            30,
        )
        adopted = [e for e in events if e.reservation_id == "ghost-1"]
        assert [(e.kind, e.router_id) for e in adopted] == [("reserve", other)]
        assert (adopted[0].cause or "").startswith("reconciler")
    finally:
        await client.aclose()


async def _true(value: bool) -> bool:
    return value


async def _stream(url: str, words: int, max_tokens: int) -> int:
    """One streamed completion read to its end (or until cancelled); its HTTP status."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            url + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "tell me everything " * words,
                "max_tokens": max_tokens,
                "stream": True,
            },
        ) as r,
    ):
        async for _ in r.content:
            pass
        return r.status


async def test_redis_restarted_empty_reconciler_restores_inflight_reservations(
    supervisor: Supervisor, kafka_settings: KafkaSettings, worker_settings: WorkerSettings
) -> None:
    await ensure_topics(kafka_settings)
    port = free_port()
    redis_argv = [
        "redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
        "no",
    ]  # fmt: skip
    supervisor.spawn_argv("redis", redis_argv)
    redis_url = f"redis://127.0.0.1:{port}/0"
    client = Redis.from_url(redis_url)
    await wait_until(lambda: _ping(client), 10, "redis to answer")
    supervisor.env.update(
        {
            "KVGATE_ADMISSION__BACKEND": "redis",
            "KVGATE_REDIS__URL": redis_url,
            "KVGATE_ADMISSION__RECONCILE_INTERVAL_S": "0.5",
            "KVGATE_ADMISSION__RECONCILE_GRACE_S": "3",
        }
    )
    c = Cluster(supervisor)
    c.add_engine("n1")
    c.add_worker()
    front = c.add_router("router-a")
    other = c.add_router("router-b")
    await c.wait_ready("router-a", 1)
    await c.wait_ready("router-b", 1)

    async def state() -> dict[str, Any]:
        return cast(dict[str, Any], await get(other, "/v1/kvgate/state"))

    # a fresh Redis is marked by the reconciler before the first admission
    await wait_until(lambda: _generation(client), 15, "the reconciler to mark the fresh store")
    calls = [asyncio.create_task(_stream(front, 30 + i, 4000)) for i in range(4)]
    try:

        async def four_held() -> bool:
            return (await state())["reservations"] == 4

        await wait_until(four_held, 15, "four reservations in Redis")
        blocks = (await state())["reserved_kv_blocks"]
        assert blocks > 0

        rebuilt_before = await rebuilds(front, other)
        supervisor.kill("redis", signal.SIGKILL)
        supervisor.spawn_argv("redis", redis_argv)  # the same port, empty
        await wait_until(lambda: _ping(client), 10, "redis to answer again")

        async def restored() -> bool:
            s = await state()
            return s["reservations"] == 4 and s["reserved_kv_blocks"] == blocks

        await wait_until(restored, 20, "the reconciler to restore the four reservations", 0.25)
        assert all(not t.done() for t in calls)  # they were in flight all along
        assert await rebuilds(front, other) > rebuilt_before

        # the rebuilt store admits again, and counts the new request on top of the restored
        status, _ = await post(
            other, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        )
        assert status == 200
    finally:
        for t in calls:
            t.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    async def released() -> bool:
        s = await state()
        empty = s["reservations"] == 0 and s["reserved_kv_blocks"] == 0
        return empty and await ledger_open(front, other) == 0

    await wait_until(released, 15, "the restored reservations to be released", 0.25)
    # nothing was fixed by compensation: the restored reservations were released by their router
    events = await read_topic(kafka_settings, LEDGER, LedgerEvent, lambda evs: len(evs) >= 10)
    assert sum(e.kind == "reserve" for e in events) == 5
    assert sum(e.kind == "release" for e in events) == 5
    assert not [e for e in events if e.kind == "expire"]
    await client.aclose()


async def rebuilds(*routers: str) -> int:
    """How many times the routers' reconcilers rebuilt an empty store."""
    total = 0
    for url in routers:
        total += (await get(url, "/v1/kvgate/state"))["reconciler"]["rebuilds"]
    return total


async def _ping(client: Redis) -> bool:
    try:
        return bool(await client.ping())
    except RedisError:
        return False


async def _generation(client: Redis) -> bool:
    try:
        return bool(await client.keys("kvgate:*:generation"))
    except RedisError:
        return False


def _count(events: list[LedgerEvent], kind: str) -> int:
    return sum(e.kind == kind for e in events)
