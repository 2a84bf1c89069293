"""kvgate's default policy: route on the expected completion cost of the request, in seconds.

For every eligible node: the time queued work needs before this request's prefill starts, the
prefill of the part of the prompt the node does not hold (the cache hit is a discount on prefill,
not a bonus), the request's decode at the node's current batch, and the stall its prefill imposes
on the decodes already running there (chunked prefill shares the step with them: long prompts
show up in everyone's TPOT). The cheapest node wins; a node over its KV or queue limit is only
chosen when every node is.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

from router.core import Candidate, NodeView, PolicyBase, RouteDecision, RouteRequest
from router.settings import CostWeights

__all__ = ["CompletionCostPolicy"]


class CompletionCostPolicy(PolicyBase):
    name = "kvgate"

    def __init__(self, w: CostWeights, max_kv_used_ratio: float, max_queue: int) -> None:
        self.w = w
        self.weights_version = w.version
        self.max_kv_used_ratio = max_kv_used_ratio
        self.max_queue = max_queue
        self._avg_prefill_s = 0.05  # EWMA of the prefill this router sends per request

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        w = self.w
        total = max(1, len(request.block_hashes))
        cands: list[Candidate] = []
        prefill_of: dict[str, float] = {}
        for n in nodes:
            hit = matches.get(n.node_id, 0)
            uncached = max(0, request.prompt_tokens - hit * n.block_size)
            prefill_s = uncached / w.prefill_tokens_per_s
            # this router's own queued prompts are known exactly; other routers' only by count
            backlog_s = n.prefill_backlog_tokens / w.prefill_tokens_per_s
            queue_s = max(backlog_s, (n.waiting + n.pending) * self._avg_prefill_s)
            batch = n.running + n.pending + 1
            tpot_s = w.step_base_s + w.step_per_seq_s * batch
            decode_s = request.max_tokens * tpot_s
            stall_s = prefill_s * n.running * w.interference
            kv_s = w.kv_pressure_s * max(0.0, n.kv_used_ratio - w.kv_soft_limit)
            parts = {
                "queue_s": queue_s,
                "prefill_s": prefill_s,
                "decode_s": decode_s,
                "stall_s": stall_s,
                "kv_s": kv_s,
            }
            prefill_of[n.node_id] = prefill_s
            cands.append(
                Candidate(
                    n.node_id,
                    -sum(parts.values()),
                    hit,
                    hit / total,
                    n.kv_used_ratio,
                    n.queue_len,
                    n.healthy,
                    parts,
                )
            )
        by_node = {n.node_id: n for n in nodes}

        def over(c: Candidate) -> bool:
            n = by_node[c.node_id]
            return n.kv_used_ratio >= self.max_kv_used_ratio or n.queue_len > self.max_queue

        salt = zlib.crc32(request.request_id.encode())
        ordered = sorted(cands, key=lambda c: (-c.score, zlib.crc32(c.node_id.encode()) ^ salt))
        within = [c for c in ordered if not over(c)]
        if within:
            best = within[0]
            reason = (
                ("prefix_hit" if best.hit_blocks else "least_cost")
                if best is ordered[0]
                else "overload_fallback"
            )
        else:
            best, reason = ordered[0], "all_overloaded"
        a = w.prefill_ewma
        self._avg_prefill_s = (1 - a) * self._avg_prefill_s + a * prefill_of[best.node_id]
        return RouteDecision(best.node_id, reason, tuple(cands))
