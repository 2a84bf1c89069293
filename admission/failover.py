"""The shared reservation store with a way down: admission goes on while no Redis primary can
be reached, within this router's share of the budget, and the store learns what happened
meanwhile once it answers again.

Every reservation this router makes, in either mode, is also kept in a local book (an
:class:`InProcessReservations` of this router's reservations alone). While the shared store
answers, calls go to it and the book follows. Once it fails to answer (connection refused or
lost, a timeout, no primary known to the Sentinels, or a store that lost its data), the router
admits against the book: at most ``share`` of each limit a request may reach (the pool's
watermark, its slots; a tenant's caps), the book counting what this router held before the
failure too. With ``share`` at 1 / the number of routers, together they stay within the budget.
The budget a router reads meanwhile is its own holdings divided by its share: its estimate of
the cluster's, so the watermarks and priorities act as before.

Every ``retry_s`` a call tries the shared store again. Before it is used again, it is told
what it missed: releases made meanwhile are applied, and every reservation in the book is
renewed there (or restored, when it was made meanwhile or lost with an old primary's last
writes). Reservations of other routers are theirs to bring back; the reconciler settles what
none of them could (admission/reconcile.py). The ledger saw every event all along.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Literal, TypeVar

from admission.exceptions import AdmissionError, StoreReset
from admission.reservations import InProcessReservations, Reservation, ReservationStore, ReserveAsk
from admission.storm import InProcessStormStore, StormStore

__all__ = ["FailoverReservations", "FailoverStorm"]

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MISSED_RELEASES = 100_000  # beyond: the reconciler drops the rest (closed on the ledger)


class _Down(Exception):
    """The shared store is not used now: answer from the book."""


class FailoverReservations:
    """A :class:`ReservationStore` over ``shared`` that admits within ``share`` of the budget
    while ``shared`` cannot answer (``share`` None: 1 / ``routers()``; 0: refuse meanwhile)."""

    def __init__(
        self,
        shared: ReservationStore,
        share: float | None = None,
        routers: Callable[[], int] = lambda: 1,
        retry_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        drain_window_s: float = 30.0,
    ) -> None:
        self.shared = shared
        self.fixed_share = share
        self.routers = routers
        self.retry_s = retry_s
        self.clock = clock
        self.book = InProcessReservations(drain_window_s=drain_window_s)
        self.down_since: float | None = None  # clock() when the shared store stopped answering
        self.failovers = 0  # times admission went to the local share
        self.local_admitted = 0
        self._share = 1.0  # fixed when the store went down
        self._retry_at = 0.0
        self._missed: dict[str, None] = {}  # released while away (insertion order: oldest first)

    # --- state -------------------------------------------------------------------------------
    @property
    def degraded(self) -> bool:
        """Admitting against this router's share of the budget (the shared store is away)."""
        return self.down_since is not None

    @property
    def share(self) -> float:
        """The share of each limit this router may hold while the shared store is away."""
        if self.fixed_share is not None:
            return self.fixed_share
        return 1.0 / max(1, self.routers())

    @property
    def down_share(self) -> float:
        """The share taken when the shared store went away (what it admits within now)."""
        return self._share

    @property
    def batch(self) -> Any:
        """The shared store's script batcher (its round-trip counters), when it has one."""
        return getattr(self.shared, "batch", None)

    def _went_down(self, exc: AdmissionError) -> None:
        if self.down_since is None:
            self.down_since = self.clock()
            self._share = self.share
            self.failovers += 1
            log.warning(
                "reservation store unavailable (%s): admitting within %.0f%% of the budget",
                exc,
                100 * self._share,
            )
        self._retry_at = self.clock() + self.retry_s

    async def _use_shared(self, now: float) -> None:
        """Raise :class:`_Down` unless the shared store is to be used for this call (after
        telling it what it missed, when it is back)."""
        if self.down_since is None:
            return
        if self._share <= 0 or self.clock() < self._retry_at:
            raise _Down
        self._retry_at = self.clock() + self.retry_s
        try:
            await self._catch_up(now)
        except AdmissionError as exc:
            log.debug("reservation store still unavailable: %s", exc)
            raise _Down from exc
        log.warning(
            "reservation store answers again after %.1f s: %d reservations held here, in it",
            self.clock() - self.down_since,
            await self.book.count(),
        )
        self.down_since = None

    async def _catch_up(self, now: float) -> None:
        if await self.shared.generation() is None:  # emptied: the reconciler rebuilds it first
            raise StoreReset("the reservation store is being rebuilt from the ledger")
        done: set[str] = set()
        while True:  # until nothing made or released meanwhile is left to tell
            while self._missed:
                rid = next(iter(self._missed))
                await self.shared.release(rid, now)
                self._missed.pop(rid, None)
            todo = [r for rid, r in (await self.book.entries()).items() if rid not in done]
            if not todo:
                return
            for r in todo:
                rid = r.reservation_id
                if await self.shared.renew(rid, r.expires_at) is None:
                    await self.shared.restore(r)
                if not self.book.holds(rid):  # released while it was put back
                    await self.shared.release(rid, now)
                done.add(rid)

    async def _shared_call(self, now: float, call: Callable[[], Awaitable[T]]) -> T:
        await self._use_shared(now)
        try:
            return await call()
        except AdmissionError as exc:
            if self.fixed_share == 0:
                raise  # refuse meanwhile, as configured
            self._went_down(exc)
            raise _Down from exc

    # --- admission ---------------------------------------------------------------------------
    def _scaled(self, ask: ReserveAsk) -> ReserveAsk:
        s = self._share

        def cap(v: int | None) -> int | None:  # a tenant keeps a slot per router
            return None if v is None else max(1, math.ceil(v * s))

        return replace(
            ask,
            limit_blocks=int(ask.limit_blocks * s),
            limit_slots=None if ask.limit_slots is None else int(ask.limit_slots * s),
            tenant_limit_blocks=cap(ask.tenant_limit_blocks),
            tenant_limit_slots=cap(ask.tenant_limit_slots),
        )

    def _local(self, ask: ReserveAsk, now: float) -> Reservation | Literal["tenant"] | None:
        r = self.book.reserve(self._scaled(ask), now)
        if not isinstance(r, Reservation):
            return r
        self.local_admitted += 1
        return replace(r, local=True)

    async def try_reserve(
        self, ask: ReserveAsk, now: float
    ) -> Reservation | Literal["tenant"] | None:
        try:
            r = await self._shared_call(now, lambda: self.shared.try_reserve(ask, now))
        except _Down:
            return self._local(ask, now)
        if isinstance(r, Reservation):
            await self.book.restore(r)
        return r

    async def reserve_unguarded(
        self, ask: ReserveAsk, now: float, guard: Sequence[str] = ()
    ) -> tuple[Reservation, int, int] | Literal["tenant", "guarded"] | None:
        try:
            got = await self._shared_call(
                now, lambda: self.shared.reserve_unguarded(ask, now, guard)
            )
        except _Down:  # the retry guard's keys are in the store too: not checked meanwhile
            r = self._local(ask, now)
            if not isinstance(r, Reservation):
                return r
            blocks, slots = await self.book.held(ask.pool)
            return r, int(blocks / self._share), int(slots / self._share)
        if isinstance(got, tuple):
            await self.book.restore(got[0])
        return got

    async def release(self, rid: str, now: float) -> Reservation | None:
        mine = await self.book.release(rid, now)
        try:
            return await self._shared_call(now, lambda: self.shared.release(rid, now))
        except _Down:
            if mine is not None:
                self._remember(rid)
            return mine

    def _remember(self, rid: str) -> None:
        self._missed[rid] = None
        while len(self._missed) > MAX_MISSED_RELEASES:
            self._missed.pop(next(iter(self._missed)))

    async def renew(self, rid: str, expires_at: float) -> Reservation | None:
        mine = await self.book.renew(rid, expires_at)
        try:
            return await self._shared_call(time.time(), lambda: self.shared.renew(rid, expires_at))
        except _Down:
            return mine

    async def expire(self, now: float) -> list[Reservation]:
        try:
            dead: list[Reservation] = await self._shared_call(now, lambda: self.shared.expire(now))
        except _Down:  # this router's own, whose leases it stopped renewing: they are over
            dead = await self.book.expire(now)
            for r in dead:
                self._remember(r.reservation_id)
            return dead
        for r in dead:
            await self.book.release(r.reservation_id, now)
        return dead

    # --- what admission reads ----------------------------------------------------------------
    async def tenant_usage(self, pool: str) -> dict[str, tuple[int, int]]:
        try:
            return await self._shared_call(time.time(), lambda: self.shared.tenant_usage(pool))
        except _Down:
            own = await self.book.tenant_usage(pool)
            s = self._share
            return {t: (int(b / s), int(n / s)) for t, (b, n) in own.items()}

    async def held(self, pool: str) -> tuple[int, int]:
        return (await self.snapshot(pool, time.time()))[:2]

    async def snapshot(self, pool: str, now: float) -> tuple[int, int, float]:
        try:
            return await self._shared_call(now, lambda: self.shared.snapshot(pool, now))
        except _Down:  # this router's holdings, as its estimate of the cluster's
            blocks, slots, drain = await self.book.snapshot(pool, now)
            s = self._share
            return int(blocks / s), int(slots / s), drain / s

    async def drain_rate(self, pool: str, now: float) -> float:
        return (await self.snapshot(pool, now))[2]

    # --- the reconciler's (straight to the shared store: it skips a pass that fails) ---------
    async def count(self) -> int:
        return await self.shared.count()

    async def entries(self) -> dict[str, Reservation]:
        return await self.shared.entries()

    async def restore(self, r: Reservation) -> bool:
        return await self.shared.restore(r)

    async def generation(self) -> str | None:
        try:
            return await self.shared.generation()
        except AdmissionError as exc:  # /ready or the reconciler noticed first
            if self.fixed_share != 0:
                self._went_down(exc)
            raise

    async def mark_generation(self, generation: str) -> None:
        await self.shared.mark_generation(generation)

    async def lead(self, who: str, ttl_s: float) -> bool:
        return await self.shared.lead(who, ttl_s)

    async def leader(self) -> str | None:
        return await self.shared.leader()

    async def present(self, who: str, now: float, window_s: float) -> int:
        return await self.shared.present(who, now, window_s)

    async def held_here(self) -> tuple[int, int]:
        """KV blocks and slots of every reservation this router holds (all pools)."""
        entries = (await self.book.entries()).values()
        return sum(r.kv_blocks for r in entries), sum(r.slots for r in entries)


class FailoverStorm:
    """The retry guard's store beside :class:`FailoverReservations`: Redis while the
    reservation store uses it, this router's own memory while that store is away (no round
    trip to a primary that is gone, and the guard keeps guarding on what this router sees)."""

    def __init__(self, shared: StormStore, reservations: FailoverReservations) -> None:
        self.shared = shared
        self.reservations = reservations
        self.local = InProcessStormStore()

    def _store(self) -> StormStore:
        return self.local if self.reservations.degraded else self.shared

    async def not_before(self, attempt: str) -> float | None:
        return await self._store().not_before(attempt)

    async def not_before_many(self, attempts: Sequence[str]) -> list[float | None]:
        return await self._store().not_before_many(attempts)

    def keys(self, attempts: Sequence[str]) -> list[str] | None:
        return self._store().keys(attempts)

    async def set_not_before(self, attempt: str, at: float, ttl_s: float) -> None:
        await self._store().set_not_before(attempt, at, ttl_s)

    async def strike(self, client: str, window_s: float) -> int:
        return await self._store().strike(client, window_s)
