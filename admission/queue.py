"""Bounded priority queues in front of the KV budget (pure; one set per router).

Above the red watermark, work that may not enter yet waits here instead of being refused at
once. Order: high before normal before low, first come first served within a class — with an
aging term: a request counts one class higher for every ``queue_aging_s`` it has waited (its
place, and the watermark it may fill to), so that under sustained saturation a lower class
still gets in instead of waiting out its deadline behind a higher one. A queue is
bounded by what it can drain, not by a count alone: a newcomer's expected wait is the KV blocks
ahead of it (its class and the classes above) plus its own, beyond its priority's limit, divided
by the rate at which reservations drain. When that wait would pass the request's deadline the
request is refused now, with that wait as its Retry-After, instead of timing out in the queue.
(With no drain observed yet the wait is unknown: the request may wait up to its deadline.)
A newcomer never overtakes waiting requests of its priority or higher, even when the budget
has room at that instant: the room is theirs (the pump admits them in order). The one
exception is bounded: an agent session's next turn arriving while its KV is still held
(``resuming``) queues ahead of its class's requests that have waited less than
``resume_overtake_s`` — its prefix is on the engine now, and may not be later.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from admission.core import (
    Budget,
    Rejection,
    RejectReason,
    Verdict,
    priority_limit,
    retry_after,
)
from admission.settings import AdmissionSettings, Priority, Tenant

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
    tenant: Tenant | None = None
    resuming: bool = False  # an agent session's next turn while its KV is held


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

    def rank(self, w: Waiting, now: float) -> int:
        """``w``'s class as the queue counts it now: its priority's place in :data:`ORDER`,
        one higher for every ``queue_aging_s`` it has waited."""
        r = ORDER.index(w.priority)
        aging = self.settings.queue_aging_s
        if aging > 0 and r:
            r = max(0, r - int(max(0.0, now - w.enqueued_at) // aging))
        return r

    def waiting_at_or_above(self, pool: str, priority: Priority, now: float) -> bool:
        """Whether requests of this priority or higher (aged into it included) wait: a
        newcomer must not overtake them. (A class's head has waited longest: it is the one
        aged furthest.)"""
        at = ORDER.index(priority)
        return any(d and self.rank(d[0], now) <= at for d in self._pool(pool).values())

    def ahead(self, pool: str, priority: Priority) -> tuple[int, int]:
        """KV blocks and requests queued at this priority and above: the room a newcomer of
        it waits behind."""
        q = self._pool(pool)
        ahead = [w for p in ORDER[: ORDER.index(priority) + 1] for w in q[p]]
        return sum(w.kv_blocks for w in ahead), len(ahead)

    def hold(self, verdict: Verdict, priority: Priority, s: AdmissionSettings) -> Verdict:
        """``verdict`` for a newcomer while others of its priority or higher wait: an admission
        becomes a place in the queue (or, for a class that does not queue, a refusal)."""
        if not verdict.admitted:
            return verdict
        if s.queue_enabled and s.queue_timeout_s.get(priority, 0.0) > 0:
            rej = Rejection(
                RejectReason.RED_WATERMARK, True, s.min_retry_after_s, "requests are queued"
            )
            return replace(verdict, admitted=False, queue=True, rejection=rej)
        return replace(
            verdict,
            admitted=False,
            rejection=Rejection(
                RejectReason.RED_WATERMARK,
                True,
                s.min_retry_after_s,
                f"requests of higher priority are queued; {priority} priority does not queue",
            ),
        )

    def expected_wait_s(self, pool: str, priority: Priority, kv_blocks: int, b: Budget) -> float:
        """Seconds until this request could enter: the work ahead of it in the queues (its
        class and above) plus its own, beyond its priority's limit, at the drain rate — in KV
        blocks and in slots (releases per second ≈ block drain / blocks per reservation),
        whichever binds."""
        ahead_blocks, ahead_n = self.ahead(pool, priority)
        share = priority_limit(priority, self.settings)
        excess_blocks = b.kv_blocks_reserved + ahead_blocks + kv_blocks - share * b.kv_blocks_total
        excess_slots = b.slots_reserved + ahead_n + 1 - share * b.slots_total
        if excess_blocks <= 0 and excess_slots <= 0:
            return 0.0
        if b.drain_blocks_per_s <= 0:
            return math.inf
        wait = max(0.0, excess_blocks) / b.drain_blocks_per_s
        if excess_slots > 0 and b.slots_reserved and b.kv_blocks_reserved:
            releases_per_s = b.drain_blocks_per_s * b.slots_reserved / b.kv_blocks_reserved
            wait = max(wait, excess_slots / releases_per_s)
        return wait

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
        if w.resuming and s.resume_overtake_s > 0:
            # ahead of its class's newer requests, behind other resuming turns and behind
            # everyone who has waited resume_overtake_s: no request is passed over for longer
            at = len(q)
            while at > 0 and not (
                q[at - 1].resuming or now - q[at - 1].enqueued_at >= s.resume_overtake_s
            ):
                at -= 1
            q.insert(at, w)
        else:
            q.append(w)
        return None

    def admissible(self, pool: str, b: Budget, now: float) -> Waiting | None:
        """The head that may enter now: the highest class as aged (:meth:`rank`; between
        equals, one native to the class before one aged into it — aging never puts a class
        behind the one below it — then the one that waited longer), FIFO within a class, up
        to the watermark of the class it has aged into."""
        best: tuple[int, int, float] | None = None
        head: Waiting | None = None
        for d in self._pool(pool).values():
            if d:
                key = (self.rank(d[0], now), ORDER.index(d[0].priority), d[0].enqueued_at)
                if best is None or key < best:
                    best, head = key, d[0]
        if head is None or best is None:
            return None
        if b.usage_after(head.kv_blocks) <= priority_limit(ORDER[best[0]], self.settings):
            return head
        return None  # a lower class never overtakes a blocked higher one

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
