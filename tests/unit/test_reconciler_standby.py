"""Only a router that reconciles follows the ledger (admission/reconciler.py): the others start
following when nobody leads, the first caught up leads, a router that no longer leads stops
following after its standby; every router counts the routers sharing the store."""

from __future__ import annotations

import asyncio

from admission.exceptions import AdmissionError
from admission.gate import AdmissionGate
from admission.reconciler import Reconciler
from admission.reservations import InProcessReservations
from admission.settings import AdmissionSettings
from streams.background import Background
from streams.ledger import LedgerBook
from streams.schemas import LedgerEvent


class Shared(InProcessReservations):
    """A store several routers share: one lease for the reconciler, their presence."""

    def __init__(self) -> None:
        super().__init__()
        self.holder: str | None = None
        self.seen: dict[str, float] = {}
        self.down = False

    async def lead(self, who: str, ttl_s: float) -> bool:
        if self.holder in (None, who):
            self.holder = who
            return True
        return False

    async def leader(self) -> str | None:
        if self.down:
            raise AdmissionError("reservation store unavailable: test")
        return self.holder

    async def present(self, who: str, now: float, window_s: float) -> int:
        if self.down:
            raise AdmissionError("reservation store unavailable: test")
        self.seen[who] = now
        return sum(1 for t in self.seen.values() if now - t <= window_s)


class Ledger(Background):
    """The ledger replica as the reconciler sees it: started, caught up, stopped."""

    def __init__(self) -> None:
        self.caught_up = asyncio.Event()
        self.book = LedgerBook()
        self.starts = self.stops = 0

    async def _run(self) -> None:
        self.caught_up.set()
        await asyncio.Event().wait()

    async def start(self) -> None:
        self.starts += 1
        self.caught_up.clear()
        await super().start()

    async def stop(self) -> None:
        self.stops += 1
        await super().stop()


async def _publish(ev: LedgerEvent) -> None:
    return None


def _reconciler(store: Shared, router: str, **kw: object) -> tuple[Reconciler, Ledger]:
    gate = AdmissionGate(AdmissionSettings(), router, _publish, store)
    ledger = Ledger()
    rec = Reconciler(gate, ledger, lambda: [], 1.0, standby_s=30.0, **kw)  # type: ignore[arg-type]
    return rec, ledger


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_only_the_reconciling_router_follows_the_ledger() -> None:
    store = Shared()
    a, ledger_a = _reconciler(store, "a")
    b, ledger_b = _reconciler(store, "b")
    # nobody leads: both start following; the first caught up leads
    assert await a.run_once(100.0) is None and await b.run_once(100.0) is None
    assert ledger_a.running and ledger_b.running
    await _settle()
    assert await a.run_once(101.0) is not None and store.holder == "a"
    assert await b.run_once(101.0) is None  # caught up, but a leads
    assert a.report([], 101.0)["ledger_open"] == 0
    # b stops following once its standby (30 s after it last saw the lead free) is over
    assert await b.run_once(125.0) is None and ledger_b.running
    assert await b.run_once(131.0) is None and not ledger_b.running
    assert b.report([], 131.0)["ledger_open"] is None
    assert not b.report([], 131.0)["following_ledger"]
    for now in (132.0, 150.0, 200.0):  # a leads on, b stays out
        assert await a.run_once(now) is not None
        assert await b.run_once(now) is None
    assert ledger_a.starts == 1 and ledger_b.starts == 1 and ledger_b.stops == 1
    # a stops (its lease runs out): b follows again, catches up and leads
    store.holder = None
    assert await b.run_once(210.0) is None and ledger_b.running
    await _settle()
    assert await b.run_once(211.0) is not None and store.holder == "b"
    assert ledger_b.starts == 2
    await ledger_a.stop()
    await ledger_b.stop()


async def test_routers_count_each_other_and_keep_the_count_while_the_store_is_away() -> None:
    store = Shared()
    a, ledger_a = _reconciler(store, "a")
    b, ledger_b = _reconciler(store, "b")
    await a.run_once(100.0)
    await b.run_once(100.0)
    await a.run_once(101.0)
    assert (a.routers_seen, b.routers_seen) == (2, 2)
    store.down = True
    try:
        await a.run_once(102.0)
    except AdmissionError:
        pass
    assert a.routers_seen == 2  # the share while the store is away: 1/2
    await ledger_a.stop()
    await ledger_b.stop()


async def test_a_sole_owner_always_follows_and_counts_itself() -> None:
    store = Shared()
    store.holder = "someone-else"  # never asked: a store of its own has no other reconciler
    rec, ledger = _reconciler(store, "a", sole_owner=True)
    await rec.run_once(100.0)
    assert ledger.running and rec.routers_seen == 1 and not store.seen
    await ledger.stop()
