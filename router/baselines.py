"""Routing policies of other open routers, re-implemented from their published logic as baselines.

Each follows the documented algorithm and defaults (sources cited per class); none shares code
with those projects.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from router.core import Candidate, NodeView, PolicyBase, RouteDecision, RouteRequest

__all__ = ["DynamoCostPolicy", "LlmdWeightedPolicy", "SglangCacheAwarePolicy"]


def _load(n: NodeView) -> int:
    return n.running + n.waiting + n.pending


def _tiebreak(request: RouteRequest, node_id: str) -> int:
    return zlib.crc32(node_id.encode()) ^ zlib.crc32(request.request_id.encode())


class SglangCacheAwarePolicy(PolicyBase):
    """SGLang model gateway, ``--policy cache_aware`` (sgl-router docs: cache_threshold 0.3,
    balance_abs_threshold 64, balance_rel_threshold 1.5).

    The router keeps an *approximate* tree per worker of the prefixes it sent there (not the
    engines' real caches), bounded per worker with LRU eviction. If the load is imbalanced —
    max − min > abs threshold and max > rel threshold × min — the least-loaded worker gets the
    request. Otherwise the worker with the highest prefix match ratio gets it when the ratio exceeds
    ``cache_threshold``; else the worker with the smallest tree (most free cache).
    """

    name = "sglang_cache_aware"
    weights_version = 0

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_blocks: int = 50_000,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.max_tree_blocks = max_tree_blocks
        self._trees: dict[str, OrderedDict[int, None]] = {}

    def _match(self, node: str, hashes: Sequence[int]) -> int:
        tree = self._trees.get(node)
        if not tree:
            return 0
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def _insert(self, node: str, hashes: Sequence[int]) -> None:
        tree = self._trees.setdefault(node, OrderedDict())
        for h in hashes:
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.max_tree_blocks:
            tree.popitem(last=False)

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        hashes = request.block_hashes
        total = max(1, len(hashes))
        own = {n.node_id: self._match(n.node_id, hashes) for n in nodes}
        cands = tuple(
            Candidate(
                n.node_id,
                own[n.node_id] / total,
                own[n.node_id],
                own[n.node_id] / total,
                n.kv_used_ratio,
                n.queue_len,
                n.healthy,
                {"load": float(_load(n))},
            )
            for n in nodes
        )
        loads = [_load(n) for n in nodes]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            best = min(nodes, key=lambda n: (_load(n), _tiebreak(request, n.node_id)))
            reason = "imbalanced_least_loaded"
        else:
            top = max(nodes, key=lambda n: (own[n.node_id], -_tiebreak(request, n.node_id)))
            if own[top.node_id] / total > self.cache_threshold:
                best, reason = top, "prefix_hit"
            else:
                best = min(
                    nodes,
                    key=lambda n: (
                        len(self._trees.get(n.node_id, ())),
                        _tiebreak(request, n.node_id),
                    ),
                )
                reason = "smallest_tree"
        self._insert(best.node_id, hashes)
        return RouteDecision(best.node_id, reason, cands)


class DynamoCostPolicy(PolicyBase):
    """NVIDIA Dynamo's KV router cost (docs "KV Cache Aware Routing"): for each worker,
    ``overlap_score_weight × prefill blocks + decode blocks``, lowest wins (temperature 0).
    Prefill blocks: the request's blocks the worker does not hold; decode blocks: the KV blocks
    active on the worker plus the request's. Default ``overlap_score_weight`` 1.0."""

    name = "dynamo_cost"
    weights_version = 0

    def __init__(self, overlap_score_weight: float = 1.0) -> None:
        self.overlap_score_weight = overlap_score_weight

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        blocks = len(request.block_hashes)
        total = max(1, blocks)
        cands = []
        for n in nodes:
            hit = matches.get(n.node_id, 0)
            prefill = blocks - hit
            decode = n.kv_blocks_used + blocks + n.pending * blocks
            cost = self.overlap_score_weight * prefill + decode
            cands.append(
                Candidate(
                    n.node_id,
                    -cost,
                    hit,
                    hit / total,
                    n.kv_used_ratio,
                    n.queue_len,
                    n.healthy,
                    {"prefill_blocks": float(prefill), "decode_blocks": float(decode)},
                )
            )
        best = max(cands, key=lambda c: (c.score, -_tiebreak(request, c.node_id)))
        return RouteDecision(
            best.node_id, "prefix_hit" if best.hit_blocks else "least_cost", tuple(cands)
        )


class LlmdWeightedPolicy(PolicyBase):
    """llm-d inference scheduler: filter → weighted scorers → pick the highest total.

    Scorers, each in [0, 1]: prefix cache (share of the request's blocks the endpoint holds),
    queue (1 for the shortest queue, 0 for the longest, linear between), KV-cache utilisation
    (1 − used ratio). Weights: prefix 3 and queue 2 are llm-d's documented default profile;
    the KV-utilisation scorer, also one of llm-d's scorers, gets weight 1 here.
    """

    name = "llmd_weighted"
    weights_version = 0

    def __init__(self, prefix: float = 3.0, queue: float = 2.0, kv: float = 1.0) -> None:
        self.w = (prefix, queue, kv)

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        total = max(1, len(request.block_hashes))
        queues = [n.queue_len + n.running for n in nodes]
        qmin, qmax = min(queues), max(queues)
        cands = []
        for n, q in zip(nodes, queues, strict=True):
            hit = matches.get(n.node_id, 0)
            parts = {
                "prefix": self.w[0] * hit / total,
                "queue": self.w[1] * (1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)),
                "kv": self.w[2] * (1.0 - min(1.0, n.kv_used_ratio)),
            }
            cands.append(
                Candidate(
                    n.node_id,
                    sum(parts.values()),
                    hit,
                    hit / total,
                    n.kv_used_ratio,
                    n.queue_len,
                    n.healthy,
                    parts,
                )
            )
        best = max(cands, key=lambda c: (round(c.score, 9), -_tiebreak(request, c.node_id)))
        return RouteDecision(
            best.node_id, "prefix_hit" if best.hit_blocks else "weighted", tuple(cands)
        )
