"""kvgate's default policy: route on the expected completion cost of the request, in seconds.

The prices are :class:`~router.decision.policies.costmodel.CostModel`'s, for every eligible
node: queued prefill, the prefill of what the node does not hold (a cache hit is a discount on
prefill, trusted as far as the index is), decode at the node's step time, the stall and the
congestion a prefill causes, KV pressure, a pull's transfer, and a session's home bonus. This
module chooses among them.

**Resident sessions** (an agent's context that fills a share of a node's KV) are placed and kept
by their own rules, not priced turn by turn: router/decision/sessionplaces.py, residency.py.

The cheapest node wins. A node over its queue limit, or where the request's new blocks
do not fit under its KV limit, is only chosen when every node is; when the node holding the
longest prefix is not chosen, the reason says why (``overload_fallback`` when it is over its
limits, ``spread`` when load made another node cheaper). Where the holder is passed over and
both engines can, the nodes are priced again with a **pull** (``pull_s``: the holder's answer
and the bytes over the link, instead of the prefill of what it brings, router/decision/pull.py);
a node that pulls is chosen with the reason ``kv_pull``.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

from router.decision.fit import over_limits
from router.decision.policies.costmodel import CostModel
from router.decision.pull import PullSource
from router.decision.sessionplaces import SessionPlaces
from router.decision.types import Candidate, NodeView, PolicyBase, RouteDecision, RouteRequest
from router.decision.weights import CostWeights

__all__ = ["CompletionCostPolicy"]


class CompletionCostPolicy(PolicyBase):
    name = "kvgate"

    def __init__(
        self,
        w: CostWeights,
        max_kv_used_ratio: float,
        max_queue: int,
        record_candidates: int = 8,
        kv_bytes_per_token: int = 131_072,
        kv_link_gbps: float = 100.0,
        pull_skips_queue: bool = False,
    ) -> None:
        self.w = w
        self.model = CostModel(w, kv_bytes_per_token, kv_link_gbps, pull_skips_queue)  # prices
        self.weights_version = w.version
        self.max_kv_used_ratio = max_kv_used_ratio
        self.max_queue = max_queue
        self.sessions = SessionPlaces(w)  # where its sessions live
        self.record_candidates = record_candidates

    def set_weights_from(self, raw: Mapping[str, object]) -> None:
        """Replace the weights at runtime (validated as a whole, or not at all)."""
        w = CostWeights.model_validate(raw)
        self.w = w
        self.weights_version = w.version
        self.model.reweigh(w)
        self.sessions.reweigh(w)

    def _over(self, n: NodeView, prompt_tokens: int, hit: int) -> bool:
        """Over its limits for this request (router/decision/fit.py :func:`over_limits`)."""
        return over_limits(n, prompt_tokens, hit, self.max_queue, self.max_kv_used_ratio)

    def _candidate(
        self,
        request: RouteRequest,
        n: NodeView,
        hit: int,
        home: str | None,
        total: int,
        floor: float,
        src: PullSource | None = None,
    ) -> Candidate:
        parts = self.model.cost(request, n, hit, floor, src)
        parts["affinity_s"] = -self.w.session_affinity_s if n.node_id == home else 0.0
        score = -sum(v for k, v in parts.items() if k != "confidence")
        return Candidate(
            n.node_id, score, hit, hit / total, n.kv_used_ratio, n.queue_len, n.healthy, parts
        )

    def _pick(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
        home: str | None,
        floor: float,
        rot: int,
        src: PullSource | None,
    ) -> tuple[list[tuple[float, int, int]], int, str]:
        """The nodes scored in order, the chosen one's index and the reason (``src``: where a
        pull would read the prefix; None: no pull priced)."""
        mget = matches.get
        scored = self.model.scores(request, home, floor, nodes, matches, rot, src)
        scored.sort()
        prompt = request.prompt_tokens

        def over(n: NodeView) -> bool:
            return self._over(n, prompt, mget(n.node_id, 0))

        best_i = next((i for _, _, i in scored if not over(nodes[i])), None)
        longest_node = max(matches, key=mget, default=None)  # type: ignore[arg-type]
        longest = mget(longest_node, 0) if longest_node is not None else 0
        resident = self.sessions.resident(request, nodes, matches, now, over, self.w, self.model)
        if resident is not None:
            best_i, reason = resident
        elif best_i is None:
            best_i, reason = scored[0][2], "all_overloaded"
        else:
            best_hit = mget(nodes[best_i].node_id, 0)
            if longest == 0:
                reason = "session_home" if nodes[best_i].node_id == home else "least_cost"
            elif best_hit >= longest:
                reason = "prefix_hit"
            elif any(n.node_id == longest_node and over(n) for n in nodes):
                reason = "overload_fallback"
            else:
                reason = "spread"
        return scored, best_i, reason

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        total_blocks = max(1, len(request.block_hashes))
        home = (
            self.sessions.home(request, nodes, matches) if self.w.session_affinity_s > 0 else None
        )
        # ties (idle, identical nodes) go to a per-request rotation of the node order, so that
        # several routers do not pile onto the same node
        rot = zlib.crc32(request.request_id.encode())
        floor = self.model.congestion(request, nodes, matches) if self.w.congestion else 0.0
        scored, best_i, reason = self._pick(request, nodes, matches, now, home, floor, rot, None)
        src = None  # a pull is priced only where the holder is passed over, or not a candidate
        if self.w.kv_pull and (reason in ("spread", "overload_fallback") or request.givers):
            src = self.model.source((*nodes, *request.givers), matches)
        if src is not None:  # loading the holder's prefix may beat computing it again
            scored, best_i, reason = self._pick(request, nodes, matches, now, home, floor, rot, src)
        mget = matches.get
        best = nodes[best_i]
        pull = self.model.pull_for(request, best, mget(best.node_id, 0), src, floor) if src else 0
        # the decision record keeps the best few candidates with their components
        keep = [i for _, _, i in scored[: self.record_candidates]]
        if best_i not in keep:
            keep.append(best_i)
        cands = tuple(
            self._candidate(
                request, nodes[i], matches.get(nodes[i].node_id, 0), home, total_blocks, floor, src
            )
            for i in keep
        )
        if pull and src is not None:
            return RouteDecision(best.node_id, "kv_pull", cands, pull=src.node_id, pull_blocks=pull)
        return RouteDecision(best.node_id, reason, cands)

    def commit(
        self, request: RouteRequest, decision: RouteDecision, uncached_tokens: int, now: float
    ) -> None:
        """The request went to ``decision.chosen``: its uncached prompt enters the average
        that costs other routers' queued requests, and the node is its session's home."""
        if decision.chosen is None:
            return
        self.model.sent(uncached_tokens)
        self.sessions.commit(request, decision.chosen, now, self.w)

    def paused(self, session_id: str, node: str, now: float, until: float) -> None:
        self.sessions.paused(session_id, node, now, until, self.w)

    def resident_tokens(self, now: float) -> dict[str, int]:
        residency = self.sessions.residency
        residency.expire(now)
        return residency.by_node()
