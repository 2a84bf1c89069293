"""The terms other rules read off a policy's cost model (pure): the weight it puts on prefill,
the prefill rate it counts a node's queue in, and how far it trusts a node's prefix hits."""

from __future__ import annotations

import math

from router.decision.types import NodeView

__all__ = ["index_confidence", "prefill_rate", "prefill_weight"]


def prefill_weight(policy: object) -> float:
    """The weight a policy's cost puts on prefill (1 for policies without a cost model): what
    turns its ``prefill_s`` component back into seconds."""
    w = getattr(policy, "w", None)
    return float(getattr(w, "prefill_weight", 1.0))


def prefill_rate(policy: object, n: NodeView) -> float | None:
    """The prefill rate a policy's cost counts ``n``'s queue in (tokens per second): learned
    or reported for the node, else the policy's configured one (None: no cost model)."""
    w = getattr(policy, "w", None)
    configured = getattr(w, "prefill_tokens_per_s", None)
    return n.prefill_tokens_per_s or (float(configured) if configured else None)


def index_confidence(n: NodeView, grace_s: float, tau_s: float) -> float:
    """How far a prefix hit on ``n`` can be trusted: 1 when the index holds every KV batch the
    node announced, or has been behind for less than ``grace_s`` (normal pipeline lag);
    otherwise decaying with how long the index has been behind."""
    if n.kv_index_gap <= 0 or n.kv_index_age_s <= grace_s:
        return 1.0
    return math.exp(-(n.kv_index_age_s - grace_s) / tau_s)
