"""Policies without a cost model: random, round robin, least requests, power of two,
consistent hashing."""

from __future__ import annotations

import random
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

__all__ = [
    "ConsistentHashPolicy",
    "LeastRequestsPolicy",
    "PowerOfTwoPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
]


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
        return RouteDecision(node.node_id, "round_robin", _candidates(nodes, matches, request))

    def commit(
        self, request: RouteRequest, decision: RouteDecision, uncached_tokens: int, now: float
    ) -> None:
        self._next += 1


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
