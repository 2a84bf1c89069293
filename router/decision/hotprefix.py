"""Hot prefixes: which shared prefixes draw more traffic than one node should carry, and which
nodes should load them ahead of time (pre-warm advice on ``kvgate.control``).

Pure: the router (and the simulator) call :meth:`HotPrefixes.observe` after each decision. A
prefix is the longest run of leading blocks some node holds (named by the hash of its last
block). Its traffic share is an exponentially decayed count over this router's decisions. A
prefix whose share × nodes exceeds ``hot_factor`` is hot: it wants ``ceil(share × nodes ×
headroom)`` holders. When it has fewer, the advice names the least-loaded non-holders (at most
``max_targets``), once per ``cooldown_s`` per prefix. The policy itself already spreads a hot
prefix by cost (its holders queue up, so other nodes become cheaper); the advice makes the next
node's first request a hit instead of a cold prefill.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from router.decision.types import NodeView

__all__ = ["HotPrefixes", "PrewarmAdvice"]


@dataclass(frozen=True, slots=True)
class PrewarmAdvice:
    prefix_hash: int  # hash of the prefix's last block
    blocks: int  # prefix length in blocks
    share: float  # of this router's recent requests
    holders: tuple[str, ...]
    targets: tuple[str, ...]  # nodes that should load it


@dataclass(slots=True)
class _Tracked:
    count: float
    at: float
    blocks: int
    advised_at: float = -math.inf


@dataclass(slots=True)
class HotPrefixes:
    half_life_s: float = 10.0
    hot_factor: float = 1.5
    headroom: float = 1.25
    cooldown_s: float = 30.0
    max_targets: int = 4
    min_requests: float = 20.0  # decayed requests seen before shares are trusted
    max_tracked: int = 4096
    _tracked: dict[int, _Tracked] = field(default_factory=dict)
    _total: float = 0.0
    _total_at: float = 0.0

    def _decay(self, value: float, since: float, now: float) -> float:
        return float(value * 0.5 ** (max(0.0, now - since) / self.half_life_s))

    def share(self, prefix_hash: int, now: float) -> float:
        t = self._tracked.get(prefix_hash)
        total = self._decay(self._total, self._total_at, now)
        if t is None or total <= 0:
            return 0.0
        return self._decay(t.count, t.at, now) / total

    def prefix_share(
        self, block_hashes: Sequence[int], matches: Mapping[str, int], now: float
    ) -> float:
        """The share of the traffic asking for the longest prefix some node holds of
        ``block_hashes`` (0 when no node holds any)."""
        depth = max(matches.values(), default=0)
        if depth <= 0 or depth > len(block_hashes):
            return 0.0
        return self.share(block_hashes[depth - 1], now)

    def observe(
        self,
        now: float,
        block_hashes: Sequence[int],
        matches: Mapping[str, int],
        nodes: Sequence[NodeView],
        advise: bool = True,
    ) -> PrewarmAdvice | None:
        """Count one routed request; returns advice when its prefix is hot and under-held
        (and ``advise``: counted only, otherwise)."""
        self._total = self._decay(self._total, self._total_at, now) + 1.0
        self._total_at = now
        depth = max(matches.values(), default=0)
        if depth <= 0 or depth > len(block_hashes):
            return None
        key = block_hashes[depth - 1]
        t = self._tracked.get(key)
        if t is None:
            if len(self._tracked) >= self.max_tracked:
                self._prune(now)
            t = self._tracked[key] = _Tracked(0.0, now, depth)
        t.count = self._decay(t.count, t.at, now) + 1.0
        t.at = now
        if not advise or self._total < self.min_requests or not nodes:
            return None
        share = t.count / self._total
        if share * len(nodes) <= self.hot_factor or now - t.advised_at < self.cooldown_s:
            return None
        holders = tuple(sorted(n for n, d in matches.items() if d >= depth))
        wanted = min(len(nodes), math.ceil(share * len(nodes) * self.headroom))
        if len(holders) >= wanted:
            return None
        held = set(holders)
        spare = sorted(
            (n for n in nodes if n.node_id not in held),
            key=lambda n: (n.running + n.waiting + n.pending, n.kv_used_ratio, n.node_id),
        )
        targets = tuple(n.node_id for n in spare[: min(self.max_targets, wanted - len(holders))])
        if not targets:
            return None
        t.advised_at = now
        return PrewarmAdvice(key, depth, share, holders, targets)

    def _prune(self, now: float) -> None:
        """Keep the busier half of the tracked prefixes."""
        ranked = sorted(
            self._tracked.items(), key=lambda kv: self._decay(kv[1].count, kv[1].at, now)
        )
        for key, _ in ranked[: len(ranked) // 2]:
            del self._tracked[key]
