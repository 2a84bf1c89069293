"""Admission while the shared reservation store is away (admission/failover.py): each router
admits within its share of the budget, its earlier holdings counted; once the store answers
again it learns every reservation made and released meanwhile, and nothing leaks or doubles."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Literal

import pytest

from admission.exceptions import AdmissionError
from admission.failover import FailoverReservations, FailoverStorm
from admission.gate import AdmissionGate
from admission.reservations import InProcessReservations, Reservation, ReserveAsk
from admission.settings import AdmissionSettings, Tenant
from admission.storm import InProcessStormStore
from router.records import admission_fields
from streams.schemas import LedgerEvent
from tests.factories import admit, screen

NORMAL = Tenant(name="chat", priority="normal")
LOW = Tenant(name="batch", priority="low")


class Flaky(InProcessReservations):
    """An in-process store that can be taken away (every call fails as a lost primary's do),
    or emptied (a primary that came back without its data)."""

    down = False
    calls = 0
    renew_s = 0.0  # each renewal takes this long (a round trip others overtake)

    def _check(self) -> None:
        self.calls += 1
        if self.down:
            raise AdmissionError("reservation store unavailable: Connection refused")

    async def try_reserve(
        self, ask: ReserveAsk, now: float
    ) -> Reservation | Literal["tenant"] | None:
        self._check()
        return await super().try_reserve(ask, now)

    async def reserve_unguarded(
        self, ask: ReserveAsk, now: float, guard: Sequence[str] = ()
    ) -> tuple[Reservation, int, int] | Literal["tenant", "guarded"] | None:
        self._check()
        return await super().reserve_unguarded(ask, now, guard)

    async def release(self, rid: str, now: float) -> Reservation | None:
        self._check()
        return await super().release(rid, now)

    async def renew(self, rid: str, expires_at: float) -> Reservation | None:
        self._check()
        await asyncio.sleep(self.renew_s)
        return await super().renew(rid, expires_at)

    async def snapshot(self, pool: str, now: float) -> tuple[int, int, float]:
        self._check()
        return await super().snapshot(pool, now)

    async def expire(self, now: float) -> list[Reservation]:
        self._check()
        return await super().expire(now)

    async def restore(self, r: Reservation) -> bool:
        self._check()
        return await super().restore(r)

    async def generation(self) -> str | None:
        self._check()
        return await super().generation()


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def ask(rid: str, blocks: int, limit: int = 1000, tenant: str = "t") -> ReserveAsk:
    return ReserveAsk(rid, "p", blocks, limit, 60.0, tenant=tenant)


def stores(share: float | None = 0.5) -> tuple[Flaky, FailoverReservations, Clock]:
    shared, clock = Flaky(), Clock()
    return shared, FailoverReservations(shared, share, retry_s=0.5, clock=clock), clock


async def test_with_the_store_up_every_call_goes_to_it_and_the_book_follows() -> None:
    shared, store, _ = stores()
    r = await store.try_reserve(ask("a", 100), 1.0)
    assert isinstance(r, Reservation) and not r.local
    assert await shared.held("p") == (100, 1)
    assert await store.held_here() == (100, 1)
    assert await store.release("a", 2.0) is not None
    assert await shared.count() == 0 and await store.held_here() == (0, 0)
    assert not store.degraded and store.failovers == 0


async def test_away_it_admits_within_its_share_counting_what_it_held_before() -> None:
    shared, store, _ = stores(share=0.5)
    assert isinstance(await store.try_reserve(ask("before", 300), 1.0), Reservation)
    shared.down = True
    # the pool's limit is 1000 blocks: half of it is this router's, 300 of which it holds
    r = await store.try_reserve(ask("a", 150), 2.0)
    assert isinstance(r, Reservation) and r.local
    assert store.degraded and store.failovers == 1
    assert await store.try_reserve(ask("b", 100), 2.0) is None  # 300 + 150 + 100 > 500
    assert isinstance(await store.try_reserve(ask("c", 50), 2.0), Reservation)
    # what admission reads meanwhile: its own holdings as its estimate of the cluster's
    blocks, slots, _ = await store.snapshot("p", 2.0)
    assert (blocks, slots) == (1000, 6)
    assert await store.held_here() == (500, 3)


async def test_tenant_caps_are_shared_the_same_way_but_never_below_one_slot() -> None:
    shared, store, _ = stores(share=0.25)
    shared.down = True
    capped = ReserveAsk("a", "p", 10, 1000, 60.0, tenant="t", tenant_limit_slots=2)
    assert isinstance(await store.try_reserve(capped, 1.0), Reservation)
    again = ReserveAsk("b", "p", 10, 1000, 60.0, tenant="t", tenant_limit_slots=2)
    assert await store.try_reserve(again, 1.0) == "tenant"


async def test_back_again_the_store_learns_what_was_made_and_released_meanwhile() -> None:
    shared, store, clock = stores(share=0.5)
    for rid in ("kept", "ended"):
        assert isinstance(await store.try_reserve(ask(rid, 100), 1.0), Reservation)
    shared.down = True
    assert isinstance(await store.try_reserve(ask("new", 100), 2.0), Reservation)
    assert isinstance(await store.try_reserve(ask("brief", 50), 2.0), Reservation)
    assert (await store.release("ended", 3.0)) is not None  # answered from the book
    assert (await store.release("brief", 3.0)) is not None
    assert await store.renew("kept", 500.0) is not None
    shared.down = False
    clock.t = 0.4  # before retry_s the store is not asked again
    calls = shared.calls
    assert isinstance(await store.try_reserve(ask("x", 10), 4.0), Reservation)
    assert shared.calls == calls and store.degraded
    clock.t = 1.0
    assert isinstance(await store.try_reserve(ask("y", 10), 5.0), Reservation)
    assert not store.degraded
    held = await shared.entries()
    assert set(held) == {"kept", "new", "x", "y"}
    assert held["kept"].expires_at == 500.0  # renewed there too
    assert await shared.held("p") == (220, 4)
    for rid in list(held):
        await store.release(rid, 6.0)
    assert await shared.count() == 0 and await store.held_here() == (0, 0)


async def test_what_is_made_and_released_while_it_catches_up_reaches_the_store_too() -> None:
    shared, store, clock = stores(share=0.5)
    shared.down = True
    for rid in ("a", "b"):
        assert isinstance(await store.try_reserve(ask(rid, 10), 1.0), Reservation)
    shared.down, shared.renew_s, clock.t = False, 0.01, 1.0
    catching_up = asyncio.create_task(store.try_reserve(ask("c", 10), 2.0))
    await asyncio.sleep(0.005)  # mid catch-up: these are answered from the book
    late = await store.try_reserve(ask("late", 10), 2.0)
    assert isinstance(late, Reservation) and late.local
    assert await store.release("a", 2.0) is not None
    assert isinstance(await catching_up, Reservation)
    assert not store.degraded
    assert set(await shared.entries()) == {"b", "c", "late"}
    assert await shared.held("p") == (30, 3)


async def test_a_store_that_came_back_empty_is_left_to_the_reconciler_first() -> None:
    shared, store, clock = stores(share=0.5)
    shared.down = True
    assert isinstance(await store.try_reserve(ask("a", 100), 1.0), Reservation)
    shared.down = False
    shared._generation = None  # type: ignore[assignment]  # emptied: not rebuilt yet
    clock.t = 1.0
    r = await store.try_reserve(ask("b", 100), 2.0)
    assert isinstance(r, Reservation) and r.local and store.degraded
    await shared.mark_generation("rebuilt")  # the reconciler restored the ledger's
    clock.t = 2.0
    assert isinstance(await store.try_reserve(ask("c", 100), 3.0), Reservation)
    assert not store.degraded
    assert set(await shared.entries()) == {"a", "b", "c"}


async def test_share_zero_refuses_while_the_store_is_away() -> None:
    shared, store, _ = stores(share=0.0)
    shared.down = True
    with pytest.raises(AdmissionError):
        await store.try_reserve(ask("a", 10), 1.0)
    assert not store.degraded


def test_the_default_share_is_one_over_the_routers_using_the_store() -> None:
    store = FailoverReservations(Flaky(), None, routers=lambda: 4)
    assert store.share == 0.25


def _gate(store: FailoverReservations) -> AdmissionGate:
    async def publish(ev: LedgerEvent) -> None:
        events.append(ev)

    events: list[LedgerEvent] = []
    s = AdmissionSettings(
        learn_output=False, queue_enabled=False, retry_guard=False, fair_share=False
    )
    return AdmissionGate(s, "rt", publish, store=store)


async def test_the_gate_sheds_by_priority_on_its_share_and_says_so_in_the_record() -> None:
    shared, store, _ = stores(share=0.5)
    gate = _gate(store)
    nodes = [1000]
    v = await screen(gate, "warm", NORMAL, "a0", "c", 160, 16, 16, "p", nodes, 1.0)
    assert v.admitted and not v.local_share
    assert admission_fields(v)["admission_reason"] == "ok"
    b = v.kv_blocks
    shared.down = True
    v = await screen(gate, "r1", NORMAL, "a1", "c", 160, 16, 16, "p", nodes, 2.0)
    assert v.admitted and v.local_share
    assert admission_fields(v)["admission_reason"] == "local_share"
    # what it holds reads as twice that of the cluster: past yellow (800 of 1000 blocks) low
    # priority is refused, past red (900) normal priority too
    i = 0
    while 2 * ((await store.held_here())[0] + b) <= 800:
        i += 1
        assert (await admit(gate, f"n{i}", NORMAL, 160, 16, 16, "p", nodes, 2.0)).admitted
    low = await admit(gate, "low", LOW, 160, 16, 16, "p", nodes, 2.0)
    assert not low.admitted and low.rejection is not None and low.rejection.retry_after_s
    assert (await admit(gate, "normal", NORMAL, 160, 16, 16, "p", nodes, 2.0)).admitted
    while (v := await admit(gate, f"m{i}", NORMAL, 160, 16, 16, "p", nodes, 2.0)).admitted:
        i += 1
    assert v.rejection is not None and v.rejection.reason == "red_watermark"
    assert v.rejection.retry_after_s is not None
    assert 450 - b < (await store.held_here())[0] <= 450  # never past its share of red


async def test_the_retry_guard_keeps_its_memory_here_while_the_store_is_away() -> None:
    shared, store, _ = stores()
    redis_like = InProcessStormStore()
    storm = FailoverStorm(redis_like, store)
    await storm.set_not_before("a", 50.0, 60.0)
    assert await redis_like.not_before("a") == 50.0
    shared.down = True
    await store.try_reserve(ask("x", 1), 1.0)  # the store is found away
    assert storm.keys(["a"]) is None  # no keys for a script that cannot run
    await storm.set_not_before("b", 70.0, 60.0)
    assert await storm.not_before_many(["a", "b"]) == [None, 70.0]
    assert await redis_like.not_before("b") is None  # nothing sent to the store meanwhile


def test_sentinels_are_host_and_port() -> None:
    from pydantic import ValidationError

    from admission.settings import RedisSettings

    assert RedisSettings(sentinels=["s-0.redis:26379"]).sentinels == ["s-0.redis:26379"]
    with pytest.raises(ValidationError):
        RedisSettings(sentinels=["s-0.redis"])
