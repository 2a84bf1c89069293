"""The seed score policy (DESIGN.md), kvgate's first policy."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

from router.decision.types import (
    Candidate,
    NodeView,
    PolicyBase,
    RouteDecision,
    RouteRequest,
)
from router.decision.weights import SeedWeights

__all__ = ["SeedScorePolicy"]


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
