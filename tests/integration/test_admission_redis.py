"""The Redis reservation store on the real Redis: racing routers never pass the limit, leases of a
dead router expire with compensation events."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from redis.asyncio import Redis

from admission.exceptions import StoreReset
from admission.gate import AdmissionGate
from admission.redis_store import RedisReservations
from admission.settings import AdmissionSettings, Tenant
from streams.schemas import LedgerEvent
from tests.conftest import REDIS
from tests.factories import admit, reserve
from tests.quotas import concurrency_and_kv_share, fair_share_when_contended

pytestmark = pytest.mark.integration

NODES = [400, 400, 400, 400]  # 1,600 KV blocks in the cluster
TENANTS = [
    Tenant(name="hi", priority="high"),
    Tenant(name="mid", priority="normal"),
    Tenant(name="lo", priority="low"),
]


async def test_four_routers_racing_never_exceed_the_watermarks() -> None:
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    # the store's limits under races: no waiting, and no per-tenant fair share (tested on its
    # own in tests/quotas.py), which with three tenants past yellow would admit far fewer
    settings = AdmissionSettings(queue_enabled=False, fair_share=False)
    events: list[LedgerEvent] = []

    async def publish(ev: LedgerEvent) -> None:
        events.append(ev)

    clients = [Redis.from_url(REDIS) for _ in range(4)]
    await RedisReservations(clients[0], prefix).mark_generation("test")
    gates = [
        AdmissionGate(settings, f"router-{i}", publish, RedisReservations(c, prefix))
        for i, c in enumerate(clients)
    ]
    held_samples: list[int] = []
    rng = random.Random(3)

    async def client(i: int) -> tuple[int, int]:
        gate = gates[i % 4]
        ok = rejected = 0
        for j in range(40):
            tenant = TENANTS[rng.randrange(3)]
            rid = f"c{i}-{j}"
            v = await admit(
                gate,
                rid,
                tenant,
                rng.randint(200, 4000),
                rng.randint(16, 512),
                16,
                "default",
                NODES,
                now=1000.0 + j,
            )
            held_samples.append((await gate.store.held("default"))[0])
            if v.admitted:
                ok += 1
                await asyncio.sleep(rng.random() * 0.01)
                if rng.random() < 0.7:
                    await gate.release(rid, now=1000.5 + j)
            else:
                rejected += 1
                assert v.rejection is not None and v.rejection.retry_after_s is not None
        return ok, rejected

    try:
        results = await asyncio.gather(*(client(i) for i in range(32)))
        total = sum(NODES)
        assert max(held_samples) <= total  # high priority may use all of it, nobody more
        # both outcomes happen: ~150 blocks a request and 30 % never released fill the 1,600
        # blocks after a dozen admissions; how many more depends on the interleaving (20-70 seen)
        assert sum(r[0] for r in results) >= 10 and sum(r[1] for r in results) > 50
        held, _ = await gates[0].store.held("default")
        live = await gates[0].store.count()
        reserve = sum(e.kv_blocks for e in events if e.kind == "reserve")
        release = sum(e.kv_blocks for e in events if e.kind == "release")
        assert held == reserve - release  # the ledger explains the store exactly
        assert live == sum(1 for e in events if e.kind == "reserve") - sum(
            1 for e in events if e.kind == "release"
        )
        # the routers "die": their leases run out and any router expires them
        expired = await gates[1].sweep(now=1000.0 + settings.lease_s + 100)
        assert expired == live
        assert await gates[2].store.held("default") == (0, 0)
        assert sum(e.kv_blocks for e in events if e.kind == "expire") == held
    finally:
        for c in clients:
            await c.aclose()


async def test_low_priority_stops_at_yellow_normal_at_red() -> None:
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    client = Redis.from_url(REDIS)

    async def publish(ev: LedgerEvent) -> None:
        return None

    store = RedisReservations(client, prefix)
    await store.mark_generation("test")
    gate = AdmissionGate(AdmissionSettings(queue_enabled=False), "r", publish, store)
    try:
        n = 0
        while (
            await admit(gate, f"lo{n}", TENANTS[2], 144, 16, 16, "default", [1000], now=1.0)
        ).admitted:
            n += 1
        assert (await gate.store.held("default"))[0] <= 800
        m = 0
        while (
            await admit(gate, f"mid{m}", TENANTS[1], 144, 16, 16, "default", [1000], now=1.0)
        ).admitted:
            m += 1
        held = (await gate.store.held("default"))[0]
        assert 800 < held <= 900 and m > 0
    finally:
        await client.aclose()


async def test_redis_store_refuses_past_the_slot_limit() -> None:
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    client = Redis.from_url(REDIS)
    try:
        store = RedisReservations(client, prefix)
        with pytest.raises(StoreReset):  # an empty Redis admits nothing until rebuilt
            await reserve(store, "a", "p", 1, 100, 0.0, 10.0)
        await store.mark_generation("test")
        assert await reserve(store, "a", "p", 1, 100, 0.0, 10.0, limit_slots=2)
        assert await reserve(store, "b", "p", 1, 100, 0.0, 10.0, limit_slots=2)
        assert await reserve(store, "c", "p", 1, 100, 0.0, 10.0, limit_slots=2) is None
        assert await store.held("p") == (2, 2)
    finally:
        await client.aclose()


@pytest.fixture
async def redis_store() -> AsyncIterator[RedisReservations]:
    """A store under its own prefix, marked as rebuilt (ready to admit)."""
    client = Redis.from_url(REDIS)
    try:
        store = RedisReservations(client, f"test:{uuid.uuid4().hex[:8]}")
        await store.mark_generation("test")
        yield store
    finally:
        await client.aclose()


async def test_redis_store_renews_a_held_lease_only(redis_store: RedisReservations) -> None:
    store, client, prefix = redis_store, redis_store.r, redis_store.prefix
    assert await reserve(store, "a", "p", 3, 100, 100.0, 10.0)
    got = await store.renew("a", 125.5)
    assert got is not None and (got.kv_blocks, got.slots, got.expires_at) == (3, 1, 125.5)
    assert (await store.entries())["a"].expires_at == 125.5
    assert await client.zscore(f"{prefix}:exp", "a") == 125.5
    assert await store.expire(120.0) == []  # the old lease (110) no longer counts
    assert await store.held("p") == (3, 1)  # renewing holds nothing more
    assert await store.renew("missing", 200.0) is None
    assert not await client.hexists(f"{prefix}:resv", "missing")
    assert [r.reservation_id for r in await store.expire(126.0)] == ["a"]
    assert await store.renew("a", 300.0) is None  # expired: not brought back


async def test_redis_store_names_its_reconciler_and_counts_its_routers(
    redis_store: RedisReservations,
) -> None:
    store = redis_store
    assert await store.leader() is None
    assert await store.lead("router-a", 5.0)
    assert not await store.lead("router-b", 5.0)
    assert await store.leader() == "router-a"
    assert await store.present("router-a", 1000.0, 600.0) == 1
    assert await store.present("router-b", 1100.0, 600.0) == 2
    assert await store.present("router-a", 1200.0, 600.0) == 2  # the same router again
    # router-b was last here at 1100: out of the window at 1701, router-a (1200) still in it
    assert await store.present("router-c", 1701.0, 600.0) == 2
    assert 0 < await store.r.pttl(f"{store.prefix}:routers") <= 600_000


@pytest.mark.parametrize("scenario", [concurrency_and_kv_share, fair_share_when_contended])
async def test_tenant_quotas_in_redis(
    scenario: Callable[[RedisReservations], Awaitable[None]], redis_store: RedisReservations
) -> None:
    await scenario(redis_store)


async def test_reservations_written_before_tenants_were_kept_still_release(
    redis_store: RedisReservations,
) -> None:
    store, client, prefix = redis_store, redis_store.r, redis_store.prefix
    # a value in the older format (no tenant field), as a previous version wrote it
    await client.hset(f"{prefix}:resv", "old", "p|5|1|100.0")
    await client.hset(f"{prefix}:held:p", mapping={"blocks": 5, "slots": 1})
    await client.zadd(f"{prefix}:exp", {"old": 100.0})
    renewed = await store.renew("old", 200.0)
    assert renewed is not None and renewed.tenant == "" and renewed.kv_blocks == 5
    released = await store.release("old", 150.0)
    assert released is not None and released.expires_at == 200.0
    assert await store.held("p") == (0, 0) and await store.tenant_usage("p") == {}


async def test_redis_storm_store_reads_attempt_and_client_at_once() -> None:
    import time

    from admission.storm import RedisStormStore, StormGuard
    from tests.unit.test_client_storm import combined_equals_separate

    client = Redis.from_url(REDIS)
    try:
        one, two = (RedisStormStore(client, f"test:{uuid.uuid4().hex[:8]}") for _ in "12")
        assert await one.not_before_many(["a", "b"]) == [None, None]
        guards = (StormGuard(one, 60.0, 600.0, 3), StormGuard(two, 60.0, 600.0, 3))
        await combined_equals_separate(*guards, time.time())
    finally:
        await client.aclose()


def test_one_round_trip_in_redis_answers_as_guard_then_admission() -> None:
    """The Lua path (retry-guard keys read in the reservation script) against the guard and
    the full admission, on Redis itself."""
    from hypothesis import given, settings

    from admission.reservations import ReservationStore
    from admission.storm import RedisStormStore, StormStore
    from tests.unit.test_admission_one_trip import Case, cases, compare

    async def run(case: Case) -> None:
        client = Redis.from_url(REDIS)

        async def make() -> tuple[ReservationStore, StormStore]:
            prefix = f"test:{uuid.uuid4().hex[:8]}"
            store = RedisReservations(client, prefix)
            await store.mark_generation("test")
            return store, RedisStormStore(client, prefix)

        try:
            await compare(case, make)
        finally:
            await client.aclose()

    @settings(max_examples=60, deadline=None)
    @given(case=cases)
    def check(case: Case) -> None:
        asyncio.run(run(case))

    check()


async def test_concurrent_scripts_share_round_trips_and_keep_their_answers(
    redis_store: RedisReservations,
) -> None:
    """200 reservations at once against a limit of 50: one round trip carries many of them,
    exactly 50 get in, each caller gets its own answer; the same after Redis forgot its scripts
    (SCRIPT FLUSH: loaded again); and against a Redis that is not there every caller gets
    AdmissionError."""
    from admission.exceptions import AdmissionError

    store = redis_store
    got = await asyncio.gather(
        *(reserve(store, f"r{i}", "p", 1, 50, 1.0, 60.0) for i in range(200))
    )
    assert sum(r is not None for r in got) == 50 and await store.held("p") == (50, 50)
    assert {r.reservation_id for r in got if r is not None} <= {f"r{i}" for i in range(200)}
    assert store.batch.round_trips < store.batch.calls / 10
    released = await asyncio.gather(*(store.release(f"r{i}", 2.0) for i in range(200)))
    assert sum(r is not None for r in released) == 50 and await store.held("p") == (0, 0)
    await store.r.script_flush()
    again = await asyncio.gather(
        *(reserve(store, f"s{i}", "p", 1, 5, 3.0, 60.0) for i in range(20))
    )
    assert sum(r is not None for r in again) == 5
    gone = RedisReservations(Redis.from_url("redis://127.0.0.1:1/0"), "test:gone")
    outcomes = await asyncio.gather(
        *(reserve(gone, f"g{i}", "p", 1, 5, 1.0, 60.0) for i in range(10)),
        return_exceptions=True,
    )
    assert all(isinstance(o, AdmissionError) for o in outcomes)
    await gone.r.aclose()
