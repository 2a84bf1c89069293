"""Reservations against the cluster KV budget: one interface, two backends.

Every admitted request holds a reservation until it completes, fails or its client leaves; each
carries a lease, so a reservation whose release was lost expires on its own (the router renews
the leases of the requests it is still serving). ``try_reserve`` is
an atomic check-and-reserve against limits in KV blocks and in slots (the watermark the
caller's priority may reach):
in-process because the event loop does not yield inside it, in Redis by a Lua script, so several
routers sharing one Redis can never together pass the limit.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

__all__ = [
    "GUARDED",
    "TENANT_LIMIT",
    "InProcessReservations",
    "Reservation",
    "ReservationStore",
    "ReserveAsk",
    "drain_rate",
]

# what ``try_reserve`` answers when the tenant's own limit (not the pool's) refused it
TENANT_LIMIT: Literal["tenant"] = "tenant"
# what ``reserve_unguarded`` answers when the retry guard holds the attempt or its client back
GUARDED: Literal["guarded"] = "guarded"


def drain_rate(released: int, oldest_s: float | None, now: float, floor_s: float = 1.0) -> float:
    """Blocks released per second over the span since the oldest release still in the window
    (not over the whole window: right after a start that would read as near zero)."""
    if oldest_s is None:
        return 0.0
    return released / max(floor_s, now - oldest_s)


@dataclass(frozen=True, slots=True)
class Reservation:
    reservation_id: str
    pool: str
    kv_blocks: int
    slots: int
    expires_at: float
    tenant: str = ""
    # made against this router's share while the shared store was away (admission/failover.py)
    local: bool = False


@dataclass(frozen=True, slots=True)
class ReserveAsk:
    """One atomic check-and-reserve: ``kv_blocks`` and one slot for ``rid`` in ``pool``, if the
    pool's reservations stay within ``limit_blocks`` and ``limit_slots`` (the watermark the
    request's priority may reach) and ``tenant``'s within its own limits (None: none); held
    for ``lease_s`` unless renewed."""

    rid: str
    pool: str
    kv_blocks: int
    limit_blocks: int
    lease_s: float
    limit_slots: int | None = None
    tenant: str = ""
    tenant_limit_blocks: int | None = None
    tenant_limit_slots: int | None = None


class ReservationStore(Protocol):
    async def try_reserve(
        self, ask: ReserveAsk, now: float
    ) -> Reservation | Literal["tenant"] | None: ...
    async def reserve_unguarded(
        self, ask: ReserveAsk, now: float, guard: Sequence[str] = ()
    ) -> tuple[Reservation, int, int] | Literal["tenant", "guarded"] | None: ...
    async def tenant_usage(self, pool: str) -> dict[str, tuple[int, int]]: ...
    async def release(self, rid: str, now: float) -> Reservation | None: ...
    async def renew(self, rid: str, expires_at: float) -> Reservation | None: ...
    async def expire(self, now: float) -> list[Reservation]: ...
    async def held(self, pool: str) -> tuple[int, int]: ...
    async def snapshot(self, pool: str, now: float) -> tuple[int, int, float]: ...
    async def drain_rate(self, pool: str, now: float) -> float: ...
    async def count(self) -> int: ...
    async def entries(self) -> dict[str, Reservation]: ...
    async def restore(self, r: Reservation) -> bool: ...
    async def generation(self) -> str | None: ...
    async def mark_generation(self, generation: str) -> None: ...
    async def lead(self, who: str, ttl_s: float) -> bool: ...
    async def leader(self) -> str | None: ...
    async def present(self, who: str, now: float, window_s: float) -> int: ...


@dataclass(slots=True)
class InProcessReservations:
    drain_window_s: float = 30.0
    _by_id: dict[str, Reservation] = field(default_factory=dict)
    _blocks: dict[str, int] = field(default_factory=dict)
    _slots: dict[str, int] = field(default_factory=dict)
    _tenants: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # pool -> [b, s]
    _released: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    _released_sum: dict[str, int] = field(default_factory=dict)
    _generation: str = field(default_factory=lambda: uuid.uuid4().hex)

    def _trim(self, pool: str, now: float) -> deque[tuple[float, int]]:
        q = self._released.setdefault(pool, deque())
        while q and now - q[0][0] > self.drain_window_s:
            self._released_sum[pool] -= q.popleft()[1]
        return q

    def reserve(self, ask: ReserveAsk, now: float) -> Reservation | Literal["tenant"] | None:
        """:meth:`try_reserve`, synchronously (the simulator's admission calls it too)."""
        if ask.rid in self._by_id:  # ids are minted per request: a repeat takes nothing
            return None
        mine = self._tenants.get(ask.pool, {}).get(ask.tenant, [0, 0])
        blocks = ask.kv_blocks
        if ask.tenant_limit_blocks is not None and mine[0] + blocks > ask.tenant_limit_blocks:
            return TENANT_LIMIT
        if ask.tenant_limit_slots is not None and mine[1] + 1 > ask.tenant_limit_slots:
            return TENANT_LIMIT
        if self._blocks.get(ask.pool, 0) + blocks > ask.limit_blocks:
            return None
        if ask.limit_slots is not None and self._slots.get(ask.pool, 0) + 1 > ask.limit_slots:
            return None
        r = Reservation(ask.rid, ask.pool, blocks, 1, now + ask.lease_s, ask.tenant)
        self._add(r, 1)
        return r

    async def try_reserve(
        self, ask: ReserveAsk, now: float
    ) -> Reservation | Literal["tenant"] | None:
        return self.reserve(ask, now)

    async def reserve_unguarded(
        self, ask: ReserveAsk, now: float, guard: Sequence[str] = ()
    ) -> tuple[Reservation, int, int] | Literal["tenant", "guarded"] | None:
        """:meth:`try_reserve` with the pool's held blocks and slots once it is in. The retry
        guard lives elsewhere in process (``guard`` is empty: the caller asked it first)."""
        r = self.reserve(ask, now)
        if not isinstance(r, Reservation):
            return r
        return r, self._blocks.get(ask.pool, 0), self._slots.get(ask.pool, 0)

    def _add(self, r: Reservation, sign: int) -> None:
        if sign > 0:
            self._by_id[r.reservation_id] = r
        self._blocks[r.pool] = self._blocks.get(r.pool, 0) + sign * r.kv_blocks
        self._slots[r.pool] = self._slots.get(r.pool, 0) + sign * r.slots
        held = self._tenants.setdefault(r.pool, {}).setdefault(r.tenant, [0, 0])
        held[0] += sign * r.kv_blocks
        held[1] += sign * r.slots
        if held == [0, 0]:
            del self._tenants[r.pool][r.tenant]

    async def tenant_usage(self, pool: str) -> dict[str, tuple[int, int]]:
        """Per tenant of ``pool``: KV blocks and slots its reservations hold."""
        return {t: (b, s) for t, (b, s) in self._tenants.get(pool, {}).items()}

    async def release(self, rid: str, now: float) -> Reservation | None:
        r = self._by_id.pop(rid, None)
        if r is not None:
            self._add(r, -1)
            self._trim(r.pool, now).append((now, r.kv_blocks))
            self._released_sum[r.pool] = self._released_sum.get(r.pool, 0) + r.kv_blocks
        return r

    async def renew(self, rid: str, expires_at: float) -> Reservation | None:
        """Move a held reservation's lease to ``expires_at`` (None: it is not held)."""
        r = self._by_id.get(rid)
        if r is None:
            return None
        r = self._by_id[rid] = replace(r, expires_at=expires_at)
        return r

    async def expire(self, now: float) -> list[Reservation]:
        dead = [r for r in self._by_id.values() if r.expires_at <= now]
        for r in dead:
            await self.release(r.reservation_id, now)
        return dead

    async def held(self, pool: str) -> tuple[int, int]:
        return self._blocks.get(pool, 0), self._slots.get(pool, 0)

    async def snapshot(self, pool: str, now: float) -> tuple[int, int, float]:
        """Held blocks, held slots and the drain rate (one call: one round trip in Redis)."""
        blocks, slots = await self.held(pool)
        return blocks, slots, await self.drain_rate(pool, now)

    async def drain_rate(self, pool: str, now: float) -> float:
        q = self._trim(pool, now)
        return drain_rate(self._released_sum.get(pool, 0), q[0][0] if q else None, now)

    async def count(self) -> int:
        return len(self._by_id)

    def get(self, rid: str) -> Reservation | None:
        return self._by_id.get(rid)

    def holds(self, rid: str) -> bool:
        return rid in self._by_id

    async def entries(self) -> dict[str, Reservation]:
        return dict(self._by_id)

    async def restore(self, r: Reservation) -> bool:
        """Put back a reservation the store lost (no limit check: it was admitted before)."""
        if r.reservation_id in self._by_id:
            return False
        self._add(r, 1)
        return True

    async def generation(self) -> str | None:
        """Changes (or is None) when the store lost its data; never, in process."""
        return self._generation

    async def mark_generation(self, generation: str) -> None:
        self._generation = generation

    async def lead(self, who: str, ttl_s: float) -> bool:
        """Whether ``who`` is the one reconciler for this store (always, in process)."""
        return True

    async def leader(self) -> str | None:
        """Who reconciles this store now (None: nobody holds the lead; in process, the
        router that owns the store leads whenever it asks)."""
        return None

    async def present(self, who: str, now: float, window_s: float) -> int:
        """``who`` is here at ``now``; how many routers use this store (seen within
        ``window_s``): one, in process."""
        return 1
