"""The prefixes this router has just had computed somewhere, before the index can show them.

When a request's first token comes back, its prompt's blocks are in that node's cache, but the
index learns it only after the agent's flush, Kafka and the fold (~150 ms). Meanwhile a router
that trusts only the index sends the next requests of that prefix elsewhere, and pays the cold
prefill once per node. Remembering its own completed prefills for ``ttl_s`` closes the gap.
(Not at dispatch: an engine does not share a prefix that is still being prefilled, so counting
it then only piles followers onto a busy node.) Pure; the live router and the simulator use it
the same way.

Per node, a block hash maps to when it was last part of a completed prefill. Block hashes chain
(a block's hash names its whole prefix), and an add stamps a prompt's leading blocks together, so
a block is never stamped later than the blocks before it: what is alive on a node is closed
under prefixes, and the match depth is found by binary search instead of a walk down the prompt.
Expired stamps are dropped in one sweep per ``ttl_s``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["RecentPrefills", "merge_matches"]


@dataclass(slots=True)
class RecentPrefills:
    ttl_s: float = 2.0
    max_blocks: int = 2048  # per prefill: the head of a very long prompt is what repeats
    _stamps: dict[str, dict[int, float]] = field(default_factory=dict)  # node -> hash -> time
    _latest: float = float("-inf")  # the newest stamp
    _swept: float = float("-inf")  # when expired stamps were last dropped

    def add(self, node: str, hashes: Sequence[int], now: float) -> None:
        head = hashes[: self.max_blocks]
        if not head:
            return
        self._sweep(now)
        stamps = self._stamps.get(node)
        if stamps is None:
            stamps = self._stamps[node] = {}
        stamps.update(dict.fromkeys(head, now))
        self._latest = max(self._latest, now)

    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Per node, how many leading blocks of ``hashes`` it prefilled within ``ttl_s``."""
        self._sweep(now)
        cutoff = now - self.ttl_s
        if self._latest <= cutoff or not hashes:
            return {}
        out: dict[str, int] = {}
        first = hashes[0]
        top = min(len(hashes), self.max_blocks)
        for node, stamps in self._stamps.items():
            if stamps.get(first, cutoff) <= cutoff:
                continue
            lo, hi = 1, top  # blocks [0, lo) alive; the answer is in [lo, hi]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if stamps.get(hashes[mid - 1], cutoff) > cutoff:
                    lo = mid
                else:
                    hi = mid - 1
            out[node] = lo
        return out

    def _sweep(self, now: float) -> None:
        if now - self._swept < self.ttl_s:
            return
        self._swept = now
        cutoff = now - self.ttl_s
        for node in list(self._stamps):
            alive = {h: t for h, t in self._stamps[node].items() if t > cutoff}
            if alive:
                self._stamps[node] = alive
            else:
                del self._stamps[node]

    def __len__(self) -> int:
        """(node, block) entries remembered (expired ones until the next sweep)."""
        return sum(len(s) for s in self._stamps.values())


def merge_matches(indexed: Mapping[str, int], recent: Mapping[str, int]) -> dict[str, int]:
    """Per node, the longer of the index's match and this router's recent-dispatch match."""
    if not recent:
        return dict(indexed)
    out = dict(indexed)
    for node, depth in recent.items():
        if depth > out.get(node, 0):
            out[node] = depth
    return out
