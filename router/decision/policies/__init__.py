"""Routing policies behind the one :class:`router.decision.types.Policy` interface."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from router.decision.policies.cost import CompletionCostPolicy
from router.decision.policies.peers import (
    DynamoCostPolicy,
    LlmdWeightedPolicy,
    SglangCacheAwarePolicy,
)
from router.decision.policies.seed import SeedScorePolicy
from router.decision.policies.simple import (
    ConsistentHashPolicy,
    LeastRequestsPolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)
from router.decision.policies.vllmstack import VllmStackKvAwarePolicy, VllmStackPrefixAwarePolicy
from router.decision.types import Policy
from router.settings import RouterSettings

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
    "kvgate": lambda s: CompletionCostPolicy(
        s.cost,
        s.max_kv_used_ratio,
        s.max_queue,
        kv_bytes_per_token=s.kv_bytes_per_token,
        kv_link_gbps=s.kv_link_gbps,
        pull_skips_queue=s.pull_priority is not None,
    ),
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
