"""Routing policies of other open routers, re-implemented from their published logic as baselines.

Each follows the documented algorithm and defaults (sources cited per class); none shares code
with those projects.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol

from router.decision.types import Candidate, NodeView, PolicyBase, RouteDecision, RouteRequest


class ActiveSequences(Protocol):
    """What a router knows of its own requests in flight (router/decision/inflight.py)."""

    def active_blocks(self, node: str) -> int: ...

    def active_requests(self, node: str) -> int: ...

    def active_overlap(self, node: str, hashes: Sequence[int]) -> int: ...


__all__ = [
    "DynamoCostPolicy",
    "LlmdWeightedPolicy",
    "SglangCacheAwarePolicy",
    "tiebreak",
]


def _load(n: NodeView) -> int:
    return n.running + n.waiting + n.pending


def tiebreak(request: RouteRequest, node_id: str) -> int:
    return zlib.crc32(node_id.encode()) ^ zlib.crc32(request.request_id.encode())


class SglangCacheAwarePolicy(PolicyBase):
    """SGLang model gateway, ``--policy cache_aware`` (sgl-project/sglang
    ``sgl-router/src/policies/cache_aware.rs``, ``CacheAwarePolicy::select_worker``, read at
    commit 026f853b; defaults of the router's command line: cache_threshold 0.3,
    balance_abs_threshold 64, balance_rel_threshold 1.5, eviction every 120 s down to
    max_tree_size 67,108,864 characters per worker).

    The router keeps an *approximate* tree per worker of the prompts it sent there (not the
    engines' real caches). Load is the router's own count of requests in flight per worker
    (``Worker::load``). If the load is imbalanced — max − min > abs threshold and max > rel
    threshold × min — the least-loaded worker gets the request (and the tree still learns it).
    Otherwise the worker with the longest prefix match gets it when the matched share of the
    prompt exceeds ``cache_threshold``; else the worker with the smallest tree.

    kvgate's copy: the in-flight count comes from the router's ledger (``sequences``, attached
    by the host; without one, heartbeat running + waiting + unreflected dispatches); the tree
    holds block hashes instead of characters (the simulator has no text), bounded at
    ``max_tree_blocks`` per worker (1,048,576 blocks of 16 tokens ≈ SGLang's 67 M characters
    at 4 characters per token), evicted least recently used at once rather than every 120 s;
    ties between equal matches go to a per-request hash.
    """

    name = "sglang_cache_aware"
    weights_version = 0
    wants_sequences = True  # the host attaches its in-flight ledger as ``sequences``

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_blocks: float = 1_048_576,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.max_tree_blocks = max_tree_blocks
        self._trees: dict[str, OrderedDict[int, None]] = {}
        self.sequences: ActiveSequences | None = None

    def _load(self, n: NodeView) -> int:
        seq = self.sequences
        return _load(n) if seq is None else seq.active_requests(n.node_id)

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
                {"load": float(self._load(n))},
            )
            for n in nodes
        )
        loads = [self._load(n) for n in nodes]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            best = min(nodes, key=lambda n: (self._load(n), tiebreak(request, n.node_id)))
            reason = "imbalanced_least_loaded"
        else:
            top = max(nodes, key=lambda n: (own[n.node_id], -tiebreak(request, n.node_id)))
            if own[top.node_id] / total > self.cache_threshold:
                best, reason = top, "prefix_hit"
            else:
                best = min(
                    nodes,
                    key=lambda n: (
                        len(self._trees.get(n.node_id, ())),
                        tiebreak(request, n.node_id),
                    ),
                )
                reason = "smallest_tree"
        return RouteDecision(best.node_id, reason, cands)

    def commit(
        self, request: RouteRequest, decision: RouteDecision, uncached_tokens: int, now: float
    ) -> None:
        """The prompt enters the chosen node's tree (the source inserts what it routes)."""
        if decision.chosen is not None:
            self._insert(decision.chosen, request.block_hashes)


class DynamoCostPolicy(PolicyBase):
    """NVIDIA Dynamo's KV router, default worker selector (ai-dynamo/dynamo
    ``lib/kv-router/src/scheduling/selector/default.rs``, ``DefaultWorkerScorer::worker_logit``;
    inputs from ``selector/mod.rs``, ``WorkerSelectionInput::row``; defaults from
    ``scheduling/config.rs``, ``impl Default for KvRouterConfig``; read at commit 07a6c9ce).

    For each worker, lowest wins::

        logit = prefill_load_scale · max(0, (active_prefill_tokens + prompt_tokens) / block_size
                                            − overlap_score_credit · overlap_blocks)
                + potential_decode_blocks + decode_active_request_weight · active_requests

    Dynamo keeps its own account of the sequences it routed (``ActiveSequences``): updated at
    dispatch, at the first token (prefill done) and at completion. ``active_prefill_tokens``: the
    uncached prompt tokens of its requests on the worker that have no first token yet;
    ``potential_decode_blocks``: the distinct prompt blocks of its requests in flight there, plus
    the request's blocks not among them (``router_assume_kv_reuse`` on; output blocks not counted,
    ``router_track_output_blocks`` off). kvgate's copy reads the same from the router's in-flight
    ledger (``sequences``, attached by the host; router/decision/inflight.py with
    ``track_blocks``); without
    it (a host that has none) it falls back to the heartbeat's KV use plus unreflected
    dispatches. Defaults: credit 1.0, credit decay 0 (off), prefill_load_scale 1.0,
    decode_active_request_weight 0, temperature 0 (the minimum; ties at random, here a
    per-request hash). Each router replica sees only its own traffic (``router_replica_sync``
    off by default, as here)."""

    name = "dynamo_cost"
    weights_version = 0
    wants_sequences = True  # the host attaches its in-flight ledger as ``sequences``…
    wants_active_blocks = True  # … keeping each request's prompt blocks

    def __init__(
        self,
        overlap_score_credit: float = 1.0,
        prefill_load_scale: float = 1.0,
        decode_active_request_weight: float = 0.0,
    ) -> None:
        self.overlap_score_credit = overlap_score_credit
        self.prefill_load_scale = prefill_load_scale
        self.decode_active_request_weight = decode_active_request_weight
        self.sequences: ActiveSequences | None = None

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        blocks = len(request.block_hashes)
        total = max(1, blocks)
        seq = self.sequences
        cands = []
        for n in nodes:
            hit = matches.get(n.node_id, 0)
            bs = n.block_size
            if seq is not None:
                raw = (n.prefill_backlog_tokens + request.prompt_tokens) / bs
                prefill = max(0.0, raw - self.overlap_score_credit * hit)
                shared = seq.active_overlap(n.node_id, request.block_hashes)
                decode = float(seq.active_blocks(n.node_id) + blocks - shared)
            else:
                prefill = float(blocks - hit)
                decode = float(n.kv_blocks_used + blocks + n.pending * blocks)
            active = n.running + n.pending if seq is None else seq.active_requests(n.node_id)
            cost = (
                self.prefill_load_scale * prefill
                + decode
                + self.decode_active_request_weight * active
            )
            cands.append(
                Candidate(
                    n.node_id,
                    -cost,
                    hit,
                    hit / total,
                    n.kv_used_ratio,
                    n.queue_len,
                    n.healthy,
                    {"prefill_blocks": prefill, "decode_blocks": decode},
                )
            )
        best = max(cands, key=lambda c: (c.score, -tiebreak(request, c.node_id)))
        return RouteDecision(
            best.node_id, "prefix_hit" if best.hit_blocks else "least_cost", tuple(cands)
        )


class LlmdWeightedPolicy(PolicyBase):
    """llm-d inference scheduler, the "intelligent inference scheduling" well-lit path: filter →
    weighted scorers → max-score picker (scorers from kubernetes-sigs/gateway-api-inference-
    extension ``pkg/epp/scheduling/framework/plugins/scorer/queue.go`` and the KV-cache
    utilisation scorer, read at commit 02308be3; weights of llm-d's guide profile:
    prefix-cache-scorer 3, kv-cache-utilization-scorer 2, queue-scorer 2).

    Scorers, each in [0, 1]: prefix cache (share of the request's blocks the endpoint holds,
    from the KV-event index: the precise scorer), queue ((max − waiting) / (max − min) over the
    candidates, 1 when all are equal: the scraped ``num_requests_waiting``), KV-cache
    utilisation (1 − used ratio). Ties at random (here a per-request hash). The EPP scrapes
    metrics every 50 ms; kvgate's heartbeats are 0.5 s apart, so the copy adds the router's
    dispatches the heartbeat does not show yet to the waiting count.
    """

    name = "llmd_weighted"
    weights_version = 0

    def __init__(self, prefix: float = 3.0, queue: float = 2.0, kv: float = 2.0) -> None:
        self.w = (prefix, queue, kv)

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        total = max(1, len(request.block_hashes))
        queues = [n.queue_len for n in nodes]  # waiting + unreflected dispatches
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
        best = max(cands, key=lambda c: (round(c.score, 9), -tiebreak(request, c.node_id)))
        return RouteDecision(
            best.node_id, "prefix_hit" if best.hit_blocks else "weighted", tuple(cands)
        )
