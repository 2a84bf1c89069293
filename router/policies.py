"""Routing policies behind the one :class:`router.core.Policy` interface."""

from __future__ import annotations

import itertools
import random
import zlib
from collections.abc import Callable, Mapping, Sequence

from router.affinity import HashRing, point
from router.baselines import (
    DynamoCostPolicy,
    LlmdWeightedPolicy,
    SglangCacheAwarePolicy,
    tiebreak,
)
from router.core import (
    Candidate,
    NodeView,
    Policy,
    PolicyBase,
    RouteDecision,
    RouteRequest,
    simple_candidates,
)
from router.costpolicy import CompletionCostPolicy
from router.settings import RouterSettings, SeedWeights
from router.vllmstack import VllmStackKvAwarePolicy, VllmStackPrefixAwarePolicy

__all__ = [
    "POLICIES",
    "TUNING_GRID",
    "ConsistentHashPolicy",
    "LeastRequestsPolicy",
    "PowerOfTwoPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "SeedScorePolicy",
    "grid_points",
    "make_policy",
]


class SeedScorePolicy(PolicyBase):
    """The seed score (DESIGN.md), highest wins:

    0.5·(prefix-hit blocks / prompt blocks) − 0.3·(KV used ratio + 0.05·queue length)
    − 0.1·unhealthy + 0.1·recent SLO attainment.

    A node over ``max_kv_used_ratio`` or ``max_queue`` is not chosen for affinity: the decision
    falls back to the best-scoring node within limits (reason ``overload_fallback``), or to the
    least-loaded node when every node is over its limits (reason ``all_overloaded``).
    """

    name = "seed_score"

    def __init__(self, weights: SeedWeights, max_kv_used_ratio: float, max_queue: int) -> None:
        self.weights = weights
        self.weights_version = weights.version
        self.max_kv_used_ratio = max_kv_used_ratio
        self.max_queue = max_queue

    def set_weights_from(self, raw: Mapping[str, object]) -> None:
        """Replace the weights at runtime (validated as a whole, or not at all)."""
        self.weights = SeedWeights.model_validate(raw)
        self.weights_version = self.weights.version

    def _over(self, n: NodeView) -> bool:
        return n.kv_used_ratio >= self.max_kv_used_ratio or n.queue_len > self.max_queue

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        w = self.weights
        total = max(1, len(request.block_hashes))
        cands: list[Candidate] = []
        for n in nodes:
            hit = matches.get(n.node_id, 0)
            frac = hit / total if request.block_hashes else 0.0
            parts = {
                "hit": w.hit * frac,
                "load": -w.load * (n.kv_used_ratio + w.queue * n.queue_len),
                "unhealthy": -w.unhealthy * (0.0 if n.healthy else 1.0),
                "slo": w.slo * n.slo_attainment,
            }
            cands.append(
                Candidate(
                    n.node_id,
                    sum(parts.values()),
                    hit,
                    frac,
                    n.kv_used_ratio,
                    n.queue_len,
                    n.healthy,
                    parts,
                )
            )
        # ties (a cold cache, idle nodes) go to the node with the least running work, then to a
        # per-request pseudo-random order so that several routers do not pile onto one node
        salt = zlib.crc32(request.request_id.encode())
        by_node = {n.node_id: n for n in nodes}

        def rank(c: Candidate) -> tuple[float, int, int]:
            n = by_node[c.node_id]
            return (
                -round(c.score, 9),
                n.running + n.pending,
                zlib.crc32(c.node_id.encode()) ^ salt,
            )

        ordered = sorted(cands, key=rank)
        best = ordered[0]
        within = [c for c in ordered if not self._over(by_node[c.node_id])]
        if within and within[0] is best:
            reason = "prefix_hit" if best.hit_blocks else "least_loaded"
            return RouteDecision(best.node_id, reason, tuple(cands))
        if within:
            return RouteDecision(within[0].node_id, "overload_fallback", tuple(cands))
        least = min(ordered, key=lambda c: (c.kv_used_ratio + 0.05 * c.queue_len, rank(c)))
        return RouteDecision(least.node_id, "all_overloaded", tuple(cands))


def _load(n: NodeView) -> int:
    return n.running + n.waiting + n.pending


def _candidates(
    nodes: Sequence[NodeView], matches: Mapping[str, int], request: RouteRequest
) -> tuple[Candidate, ...]:
    return simple_candidates(nodes, matches, request, lambda n: -float(_load(n)))


class RandomPolicy(PolicyBase):
    """Uniformly random among eligible nodes."""

    name = "random"
    weights_version = 0

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        return RouteDecision(
            self._rng.choice(nodes).node_id, "random", _candidates(nodes, matches, request)
        )


class RoundRobinPolicy(PolicyBase):
    """The next node in id order, whatever its load."""

    name = "round_robin"
    weights_version = 0

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        ordered = sorted(nodes, key=lambda n: n.node_id)
        node = ordered[self._next % len(ordered)]
        self._next += 1
        return RouteDecision(node.node_id, "round_robin", _candidates(nodes, matches, request))


class LeastRequestsPolicy(PolicyBase):
    """Fewest running + waiting (+ this router's unreflected) requests."""

    name = "least_requests"
    weights_version = 0

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        best = min(nodes, key=lambda n: (_load(n), tiebreak(request, n.node_id)))
        return RouteDecision(best.node_id, "least_requests", _candidates(nodes, matches, request))


class PowerOfTwoPolicy(PolicyBase):
    """Two random nodes, the less loaded one wins (Mitzenmacher's power of two choices)."""

    name = "power_of_two"
    weights_version = 0

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        pair = self._rng.sample(list(nodes), min(2, len(nodes)))
        best = min(pair, key=_load)
        return RouteDecision(best.node_id, "power_of_two", _candidates(nodes, matches, request))


class ConsistentHashPolicy(PolicyBase):
    """A hash ring (``vnodes`` points per node) keyed by the session, else the prompt's first
    block: the same prefix always lands on the same node while the node set is stable."""

    name = "consistent_hash"
    weights_version = 0

    def __init__(self, vnodes: int = 64) -> None:
        self._ring = HashRing(vnodes)

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        if request.session_id is not None:
            key = point(request.session_id)
        elif request.block_hashes:
            key = request.block_hashes[0] & 0xFFFFFFFF
        else:
            key = point(request.request_id)
        chosen = self._ring.owner(key, (n.node_id for n in nodes))
        assert chosen is not None  # nodes is not empty
        return RouteDecision(chosen, "consistent_hash", _candidates(nodes, matches, request))


POLICIES: dict[str, Callable[[RouterSettings], Policy]] = {
    "seed_score": lambda s: SeedScorePolicy(s.weights, s.max_kv_used_ratio, s.max_queue),
    "random": lambda s: RandomPolicy(),
    "round_robin": lambda s: RoundRobinPolicy(),
    "least_requests": lambda s: LeastRequestsPolicy(),
    "power_of_two": lambda s: PowerOfTwoPolicy(),
    "consistent_hash": lambda s: ConsistentHashPolicy(),
    "sglang_cache_aware": lambda s: SglangCacheAwarePolicy(**s.policy_params),
    "dynamo_cost": lambda s: DynamoCostPolicy(**s.policy_params),
    "llmd_weighted": lambda s: LlmdWeightedPolicy(**s.policy_params),
    "vllm_prefix_aware": lambda s: VllmStackPrefixAwarePolicy(**s.policy_params),
    "vllm_kv_aware": lambda s: VllmStackKvAwarePolicy(**s.policy_params),
    "kvgate": lambda s: CompletionCostPolicy(s.cost, s.max_kv_used_ratio, s.max_queue),
}
# the peers' parameters a tuned variant searches (docs/baselines.md, "Tuned peers"); the first
# value of each is the peer's default
TUNING_GRID: dict[str, dict[str, tuple[float, ...]]] = {
    "dynamo_cost": {
        "overlap_score_credit": (1.0, 0.5, 2.0),
        "prefill_load_scale": (1.0, 0.5, 2.0),
    },
    "sglang_cache_aware": {
        "cache_threshold": (0.3, 0.1, 0.5),
        "balance_abs_threshold": (64, 8, 32),
    },
    "llmd_weighted": {"prefix": (3.0, 1.0, 5.0), "queue": (2.0, 1.0, 4.0)},
    "vllm_kv_aware": {"kv_aware_threshold": (2000, 500, 8000)},
    "vllm_prefix_aware": {"min_match_blocks": (0, 8, 32)},
}


def grid_points(policy: str) -> list[dict[str, float]]:
    """Every combination of ``policy``'s TUNING_GRID values, the defaults first."""
    grid = TUNING_GRID[policy]
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def make_policy(settings: RouterSettings) -> Policy:
    factory = POLICIES.get(settings.policy)
    if factory is None:
        raise ValueError(f"unknown policy {settings.policy!r}; known: {sorted(POLICIES)}")
    if settings.policy_params and settings.policy not in TUNING_GRID:
        raise ValueError(f"policy {settings.policy!r} takes no policy_params")
    try:
        return factory(settings)
    except TypeError as exc:  # an unknown keyword
        raise ValueError(f"bad policy_params for {settings.policy!r}: {exc}") from exc
