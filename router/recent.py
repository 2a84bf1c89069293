"""The prefixes this router has just had computed somewhere, before the index can show them.

When a request's first token comes back, its prompt's blocks are in that node's cache, but the
index learns it only after the agent's flush, Kafka and the fold (~150 ms). Meanwhile a router
that trusts only the index sends the next requests of that prefix elsewhere, and pays the cold
prefill once per node. Remembering its own completed prefills for ``ttl_s`` closes the gap.
(Not at dispatch: an engine does not share a prefix that is still being prefilled, so counting
it then only piles followers onto a busy node.) Pure; the live router and the simulator use it
the same way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from streams.prefix_index import PrefixIndex

__all__ = ["RecentPrefills", "merge_matches"]


@dataclass(slots=True)
class RecentPrefills:
    ttl_s: float = 2.0
    max_blocks: int = 2048  # per dispatch: the head of a very long prompt is what repeats
    _index: PrefixIndex = field(default_factory=PrefixIndex)
    _stamp: dict[tuple[str, int], float] = field(default_factory=dict)
    _queue: deque[tuple[float, str, Sequence[int]]] = field(default_factory=deque)

    def add(self, node: str, hashes: Sequence[int], now: float) -> None:
        self.expire(now)
        head = hashes[: self.max_blocks]
        if not head:
            return
        self._index.add_many(node, head)
        stamp = self._stamp
        for h in head:
            stamp[(node, h)] = now
        self._queue.append((now, node, head))

    def expire(self, now: float) -> None:
        q = self._queue
        cutoff = now - self.ttl_s
        while q and q[0][0] <= cutoff:
            at, node, head = q.popleft()
            gone = [h for h in head if self._stamp.get((node, h), at) <= at]
            for h in gone:
                self._stamp.pop((node, h), None)
            self._index.remove_many(node, gone)

    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        self.expire(now)
        if not self._queue:
            return {}
        return self._index.match(hashes)

    def __len__(self) -> int:
        return len(self._stamp)


def merge_matches(indexed: Mapping[str, int], recent: Mapping[str, int]) -> dict[str, int]:
    """Per node, the longer of the index's match and this router's recent-dispatch match."""
    if not recent:
        return dict(indexed)
    out = dict(indexed)
    for node, depth in recent.items():
        if depth > out.get(node, 0):
            out[node] = depth
    return out
