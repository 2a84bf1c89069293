"""The order of the requests waiting in a router (pure: the live router's queue,
router/flow/waiting.py, and the simulator both use it)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["UNKNOWN", "HoldQueue"]

T = TypeVar("T")

UNKNOWN = ""  # what a held request names as its blocker when it cannot tell


class HoldQueue(Generic[T]):
    """The requests waiting in the router, smallest :meth:`Lanes.key` first."""

    def __init__(self, max_blocked_long: int = 8, max_failed: int = 64) -> None:
        # (key, tie, long, item, the node that held it back last time: UNKNOWN when none)
        self._heap: list[tuple[float, int, bool, T, str]] = []
        self._tie = itertools.count()
        self.max_blocked_long = max_blocked_long
        self.max_failed = max_failed

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, key: float, long: bool, item: T, blocker: str = UNKNOWN) -> None:
        heapq.heappush(self._heap, (key, next(self._tie), long, item, blocker))

    def release(self, attempt: Callable[[T], str | None]) -> int:
        """Offer the waiting requests a place in order. ``attempt`` sends one and returns None,
        or returns the node that holds it back (its best node, queued; :data:`UNKNOWN` when it
        cannot tell). A queued node holds back only the requests that want it: a short request
        held by a node already found queued in this round is passed over without routing it
        again, the ones behind it whose best node has room go (requests with prefix affinity
        want different nodes; stopping at the first held one would leave idle engines behind a
        busy one). A round stops at a short request held for an unknown reason (the ones behind
        it would be too), after ``max_blocked_long`` long ones held (no node has long-request
        room), or after ``max_failed`` attempts that did not send. Returns how many went."""
        kept: list[tuple[float, int, bool, T, str]] = []
        busy: set[str] = set()
        sent = blocked_long = failed = 0
        heap = self._heap
        while heap:
            key, tie, long, item, blocker = heapq.heappop(heap)
            if not long and blocker != UNKNOWN and blocker in busy:
                kept.append((key, tie, long, item, blocker))
                continue
            got = attempt(item)
            if got is None:
                sent += 1
                continue
            kept.append((key, tie, long, item, got))
            failed += 1
            if long:
                blocked_long += 1
                if blocked_long >= self.max_blocked_long:
                    break
            elif got == UNKNOWN:
                break
            else:
                busy.add(got)
            if failed >= self.max_failed:
                break
        for entry in kept:
            heapq.heappush(heap, entry)
        return sent
