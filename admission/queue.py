"""Bounded priority queues in front of the KV budget (pure; one set per router).

Above the red watermark, work that may not enter yet waits here instead of being refused at
once. Order: high before normal before low, first come first served within a class. A queue is
bounded by what it can drain, not by a count alone: a newcomer's expected wait is the KV blocks
ahead of it (its class and the classes above) plus its own, beyond its priority's limit, divided
by the rate at which reservations drain. When that wait would pass the request's deadline the
request is refused now, with that wait as its Retry-After, instead of timing out in the queue.
(With no drain observed yet the wait is unknown: the request may wait up to its deadline.)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from admission.core import Budget, Rejection, RejectReason, priority_limit, retry_after
from admission.settings import AdmissionSettings, Priority

__all__ = ["AdmissionQueues", "Waiting"]

ORDER: tuple[Priority, ...] = ("high", "normal", "low")


@dataclass(slots=True, eq=False)
class Waiting:
    request_id: str
    pool: str
    priority: Priority
    kv_blocks: int
    enqueued_at: float
    deadline: float


@dataclass(slots=True)
class AdmissionQueues:
    settings: AdmissionSettings
    _queues: dict[str, dict[Priority, deque[Waiting]]] = field(default_factory=dict)

    def _pool(self, pool: str) -> dict[Priority, deque[Waiting]]:
        q = self._queues.get(pool)
        if q is None:
            q = self._queues[pool] = {p: deque() for p in ORDER}
        return q

    def __len__(self) -> int:
        return sum(len(d) for q in self._queues.values() for d in q.values())

    def depth(self, pool: str) -> dict[str, int]:
        return {p: len(d) for p, d in self._pool(pool).items()}

    def pools(self) -> list[str]:
        return [p for p, q in self._queues.items() if any(q.values())]

    def expected_wait_s(self, pool: str, priority: Priority, kv_blocks: int, b: Budget) -> float:
        q = self._pool(pool)
        ahead = sum(w.kv_blocks for p in ORDER[: ORDER.index(priority) + 1] for w in q[p])
        limit = priority_limit(priority, self.settings) * b.kv_blocks_total
        excess = b.kv_blocks_reserved + ahead + kv_blocks - limit
        if excess <= 0:
            return 0.0
        return excess / b.drain_blocks_per_s if b.drain_blocks_per_s > 0 else math.inf

    def offer(self, w: Waiting, b: Budget, now: float) -> Rejection | None:
        """Queue ``w``, or the reason it cannot wait (None: queued)."""
        s = self.settings
        q = self._pool(w.pool)[w.priority]
        wait = self.expected_wait_s(w.pool, w.priority, w.kv_blocks, b)
        if w.deadline <= now:
            return Rejection(
                RejectReason.RED_WATERMARK,
                True,
                retry_after(wait, s),
                f"cluster KV budget full; {w.priority} priority does not queue",
            )
        if len(q) >= s.queue_max_entries:
            return Rejection(
                RejectReason.QUEUE_FULL,
                True,
                retry_after(wait, s),
                f"the {w.priority} queue holds {len(q)} requests",
            )
        if math.isfinite(wait) and now + wait > w.deadline:  # no drain seen yet: may wait
            return Rejection(
                RejectReason.QUEUE_TIMEOUT,
                True,
                retry_after(wait, s),
                f"expected wait {wait:.1f} s exceeds the {w.deadline - now:.1f} s "
                f"{w.priority} queue limit",
            )
        q.append(w)
        return None

    def admissible(self, pool: str, b: Budget) -> Waiting | None:
        """The head that may enter now: strict priority, FIFO within a class."""
        for p in ORDER:
            d = self._pool(pool)[p]
            if d:
                head = d[0]
                limit = priority_limit(p, self.settings) * b.kv_blocks_total
                if b.kv_blocks_reserved + head.kv_blocks <= limit:
                    return head
                return None  # a lower class never overtakes a blocked higher one
        return None

    def remove(self, w: Waiting) -> bool:
        d = self._pool(w.pool)[w.priority]
        try:
            d.remove(w)
        except ValueError:
            return False
        return True

    def expired(self, now: float) -> list[Waiting]:
        out = []
        for q in self._queues.values():
            for d in q.values():
                for w in [w for w in d if w.deadline <= now]:
                    d.remove(w)
                    out.append(w)
        return out
