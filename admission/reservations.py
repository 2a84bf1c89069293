"""Reservations against the cluster KV budget, in-process backend (one router).

Every admitted request holds a reservation until it completes, fails or its client leaves; each
carries a lease, so a reservation whose release was lost expires on its own. Check-and-reserve is
atomic because the router's event loop runs ``admit`` and ``reserve`` without yielding in between.
A shared Redis backend (several routers) implements the same methods.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["InProcessReservations", "Reservation"]


@dataclass(frozen=True, slots=True)
class Reservation:
    reservation_id: str
    pool: str
    kv_blocks: int
    slots: int
    expires_at: float


@dataclass(slots=True)
class InProcessReservations:
    drain_window_s: float = 30.0
    _by_id: dict[str, Reservation] = field(default_factory=dict)
    _blocks: dict[str, int] = field(default_factory=dict)
    _slots: dict[str, int] = field(default_factory=dict)
    _released: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._by_id)

    def reserve(
        self, rid: str, pool: str, kv_blocks: int, now: float, lease_s: float, slots: int = 1
    ) -> Reservation:
        r = Reservation(rid, pool, kv_blocks, slots, now + lease_s)
        self._by_id[rid] = r
        self._blocks[pool] = self._blocks.get(pool, 0) + kv_blocks
        self._slots[pool] = self._slots.get(pool, 0) + slots
        return r

    def release(self, rid: str, now: float) -> Reservation | None:
        r = self._by_id.pop(rid, None)
        if r is not None:
            self._blocks[r.pool] -= r.kv_blocks
            self._slots[r.pool] -= r.slots
            q = self._released.setdefault(r.pool, deque())
            q.append((now, r.kv_blocks))
            while q and now - q[0][0] > self.drain_window_s:
                q.popleft()
        return r

    def expire(self, now: float) -> list[Reservation]:
        """Release every reservation whose lease ran out (its router lost track of it)."""
        dead = [r for r in self._by_id.values() if r.expires_at <= now]
        for r in dead:
            self.release(r.reservation_id, now)
        return dead

    def held(self, pool: str) -> tuple[int, int]:
        """(KV blocks, slots) reserved in ``pool``."""
        return self._blocks.get(pool, 0), self._slots.get(pool, 0)

    def drain_rate(self, pool: str, now: float) -> float:
        """KV blocks released per second over the recent window."""
        q = self._released.get(pool)
        if not q:
            return 0.0
        while q and now - q[0][0] > self.drain_window_s:
            q.popleft()
        return sum(b for _, b in q) / self.drain_window_s
