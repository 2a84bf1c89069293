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

__all__ = ["PendingPrefixes", "RecentPrefills", "known_matches", "merge_matches"]


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


@dataclass(slots=True)
class PendingPrefixes:
    """The prompts this router has sent and whose prefill is still running: from the dispatch
    until the first token (or the end), the node holds the prefix for routing purposes.

    A follower of a prompt whose first prefill is still queued matches nowhere in the index or
    in :class:`RecentPrefills`; sent to the cheapest node it prefills the prompt a second time,
    and caches fill with copies. Counted as a hit on the node where the prefix is being
    computed, a follower's cost there includes queueing behind that prefill (the node's prefill
    backlog holds it), which the cost policy weighs against computing the prompt elsewhere.
    (An engine shares a prefix only once it is computed: a follower scheduled in the same step
    as the first prefill computes it again. Behind it in the queue, it hits.)

    Per node, a block hash maps to the number of pending prompts that contain it; each prompt
    adds its leading blocks, so what is pending on a node is closed under prefixes and the match
    depth is found by binary search."""

    max_blocks: int = 2048  # per prompt: the head of a very long prompt is what repeats
    _held: dict[str, dict[int, int]] = field(default_factory=dict)  # node -> hash -> prompts

    def add(self, node: str, hashes: Sequence[int]) -> tuple[int, ...]:
        """``hashes`` are being prefilled on ``node``; returns what to :meth:`remove` later."""
        head = tuple(hashes[: self.max_blocks])
        if head:
            held = self._held.setdefault(node, {})
            for h in head:
                held[h] = held.get(h, 0) + 1
        return head

    def remove(self, node: str, head: Sequence[int]) -> None:
        """The prefill of ``head`` on ``node`` is over (its first token, or the request's end)."""
        held = self._held.get(node)
        if held is None:
            return
        for h in head:
            left = held.get(h, 0) - 1
            if left > 0:
                held[h] = left
            else:
                held.pop(h, None)
        if not held:
            del self._held[node]

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per node, how many leading blocks of ``hashes`` are being prefilled there."""
        if not self._held or not hashes:
            return {}
        out: dict[str, int] = {}
        first, top = hashes[0], min(len(hashes), self.max_blocks)
        for node, held in self._held.items():
            if first not in held:
                continue
            lo, hi = 1, top
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid - 1] in held:
                    lo = mid
                else:
                    hi = mid - 1
            out[node] = lo
        return out

    def __len__(self) -> int:
        """(node, block) entries pending."""
        return sum(len(h) for h in self._held.values())


def merge_matches(indexed: Mapping[str, int], recent: Mapping[str, int]) -> dict[str, int]:
    """Per node, the longer of the index's match and this router's recent-dispatch match."""
    if not recent:
        return dict(indexed)
    out = dict(indexed)
    for node, depth in recent.items():
        if depth > out.get(node, 0):
            out[node] = depth
    return out


def known_matches(
    indexed: Mapping[str, int],
    hashes: Sequence[int],
    now: float,
    recent: RecentPrefills | None,
    pending: PendingPrefixes | None,
) -> dict[str, int]:
    """Per node, the prefix of ``hashes`` it holds as this router knows it: the index's match,
    or longer where the router had the prompt prefilled just now (``recent``) or is having it
    prefilled (``pending``: only where that goes past what any node holds already — a prompt
    whose head is cached somewhere is a cached prompt, and the holders' costs decide; what is
    pending counts for a prefix new to the cluster). The live router and the simulator both
    match through here."""
    matches = dict(indexed)
    if recent is not None:
        matches = merge_matches(matches, recent.match(hashes, now))
    if pending is not None:  # only past what any node holds already: a prefix new to the cluster
        held = max(matches.values(), default=0)
        matches = merge_matches(
            matches, {n: d for n, d in pending.match(hashes).items() if d > held}
        )
    return matches
