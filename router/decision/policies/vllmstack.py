"""The vLLM production-stack router's policies, re-implemented as baselines (see
router/decision/policies/peers.py for the other peers and docs/baselines.md for every
difference)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping, Sequence

from router.decision.affinity import HashRing, point
from router.decision.policies.peers import tiebreak
from router.decision.types import (
    Candidate,
    NodeView,
    PolicyBase,
    RouteDecision,
    RouteRequest,
    simple_candidates,
)

__all__ = ["VllmStackKvAwarePolicy", "VllmStackPrefixAwarePolicy"]


class _RoutedQps:
    """The vLLM production-stack router's request statistics as its ``_qps_routing`` reads them
    (``stats/request_stats.py``, ``RequestStatsMonitor``): per endpoint, the requests *it* sent
    there in the last ``window_s`` seconds (``--request-stats-window``, 60 by default)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._sent: dict[str, deque[float]] = {}

    def record(self, node: str, now: float) -> None:
        sent = self._sent.setdefault(node, deque())
        sent.append(now)
        while sent[0] < now - self.window_s:  # bounded by the window even if never read
            sent.popleft()

    def lowest(self, nodes: Sequence[NodeView], now: float) -> str:
        """``_qps_routing``: an endpoint it never sent to first, else the lowest rate, the first
        such in the endpoint list on ties."""
        best, lowest = nodes[0].node_id, float("inf")
        for n in nodes:
            sent = self._sent.get(n.node_id)
            if sent is None:
                return n.node_id
            while sent and sent[0] < now - self.window_s:
                sent.popleft()
            qps = len(sent) / self.window_s
            if qps < lowest:
                best, lowest = n.node_id, qps
        return best


def _plain_candidates(
    nodes: Sequence[NodeView], matches: Mapping[str, int], request: RouteRequest
) -> tuple[Candidate, ...]:
    return simple_candidates(nodes, matches, request, lambda n: float(matches.get(n.node_id, 0)))


class VllmStackPrefixAwarePolicy(PolicyBase):
    """vLLM production-stack router, ``--routing-logic prefixaware`` (vllm-project/production-
    stack ``src/vllm_router/routers/routing_logic.py``, ``PrefixAwareRouter.route_request``, and
    ``src/vllm_router/prefix/hashtrie.py``, ``HashTrie``; read at commit a6c01db0,
    vllm-stack 0.1.12+14).

    The router keeps one trie of the prompts it has sent, chunked and hashed, each trie node
    holding the endpoints that were sent a prompt through it; nothing is ever evicted ("we
    assume that there is no eviction of prefix cache"). A request goes to a random endpoint
    among those at its deepest matching trie node (all endpoints when nothing matches), and
    the prompt is inserted under the chosen endpoint. No load enters the choice. When the match
    is shorter than ``--prefix-min-match-length`` (0 by default, i.e. never) the request goes
    to the endpoint with the lowest routed QPS instead (still inserted).

    kvgate's copy: chunks are the request's chained block hashes (16 tokens ≈ 64 characters;
    the source chunks 128 characters), so a flat map from block hash to endpoints is the trie;
    ``min_match_blocks`` is the threshold in blocks. The random choice is seeded. The map holds
    at most ``max_blocks`` hashes, the oldest first out (the source's trie grows without
    bound; a live router must not — no benchmark workload comes near it).
    """

    name = "vllm_prefix_aware"
    weights_version = 0

    def __init__(self, min_match_blocks: float = 0, max_blocks: float = 4_194_304) -> None:
        self.min_match_blocks = min_match_blocks
        self.max_blocks = max_blocks
        self._trie: dict[int, set[str]] = {}  # insertion-ordered: the oldest first
        self._rng = random.Random(0)  # reproducible runs
        self._qps = _RoutedQps()

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        selected = {n.node_id for n in nodes}
        depth = 0
        for h in request.block_hashes:
            holders = self._trie.get(h)
            if holders is None:
                break
            common = holders & selected
            if not common:
                break
            depth += 1
            selected = common
        if depth < self.min_match_blocks:
            chosen, reason = self._qps.lowest(nodes, now), "lowest_qps"
        else:
            chosen = self._rng.choice(sorted(selected))
            reason = "prefix_hit" if depth else "random"
        return RouteDecision(chosen, reason, _plain_candidates(nodes, matches, request))

    def commit(
        self, request: RouteRequest, decision: RouteDecision, uncached_tokens: int, now: float
    ) -> None:
        """The prompt is inserted under the chosen endpoint, and counted in its QPS."""
        chosen = decision.chosen
        if chosen is None:
            return
        trie = self._trie
        for h in request.block_hashes:
            trie.setdefault(h, set()).add(chosen)
        while len(trie) > self.max_blocks:
            del trie[next(iter(trie))]
        self._qps.record(chosen, now)


class VllmStackKvAwarePolicy(PolicyBase):
    """vLLM production-stack router, ``--routing-logic kvaware`` (vllm-project/production-stack
    ``src/vllm_router/routers/routing_logic.py``, ``KvawareRouter.route_request``; read at
    commit a6c01db0, vllm-stack 0.1.12+14).

    The router asks LMCache's controller which instance holds the longest cached prefix of the
    tokenized prompt (the engines' real caches). If one does and the match covers all but at
    most ``kv_aware_threshold`` tokens (2,000 by default) of the prompt, the request goes
    there. Otherwise it falls back to the session router: the endpoint that owns the session id
    on a consistent-hash ring (uhashring), or, without a session id, the endpoint with the
    lowest routed QPS over the last 60 s. No load enters the cache-hit choice.

    kvgate's copy: the longest match comes from kvgate's KV-event index (``matches``, the same
    information the controller holds); ties among equally long matches go to a per-request hash
    (the source takes the controller's first key). The ring has 160 points per endpoint (as
    uhashring's 40 vnodes × 4 replicas). The session id is used whenever the request has one
    (a deployment that sets ``--session-key``).
    """

    name = "vllm_kv_aware"
    weights_version = 0

    def __init__(self, kv_aware_threshold: float = 2000) -> None:
        self.threshold = kv_aware_threshold
        self._ring = HashRing(160)
        self._qps = _RoutedQps()

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        top = max(nodes, key=lambda n: (matches.get(n.node_id, 0), -tiebreak(request, n.node_id)))
        hit_tokens = matches.get(top.node_id, 0) * top.block_size
        if hit_tokens > 0 and hit_tokens >= request.prompt_tokens - self.threshold:
            chosen, reason = top.node_id, "prefix_hit"
        elif request.session_id is not None:
            owner = self._ring.owner(point(request.session_id), (n.node_id for n in nodes))
            assert owner is not None  # nodes is not empty
            chosen, reason = owner, "session"
        else:
            chosen, reason = self._qps.lowest(nodes, now), "lowest_qps"
        return RouteDecision(chosen, reason, _plain_candidates(nodes, matches, request))

    def commit(
        self, request: RouteRequest, decision: RouteDecision, uncached_tokens: int, now: float
    ) -> None:
        if decision.chosen is not None:
            self._qps.record(decision.chosen, now)
