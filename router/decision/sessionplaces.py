"""Where the cost policy's sessions live (router/decision/policies/cost.py): the node of each
session's last turn (soft affinity, and the consistent-hash home of a session no node holds any
of), and the resident long-context sessions (router/decision/residency.py). A router's own
memory, learned only from requests it routed (:meth:`SessionPlaces.commit`), never from dry
runs."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from router.decision.affinity import HashRing, point
from router.decision.residency import Pace, Residency
from router.decision.types import NodeView, RouteRequest
from router.decision.weights import CostWeights

__all__ = ["SESSION_HOMES", "SessionPlaces"]

SESSION_HOMES = 100_000  # sessions whose last node a router remembers (least recent go first)


class SessionPlaces:
    def __init__(self, w: CostWeights) -> None:
        self.ring = HashRing(c=w.affinity_load_bound)
        # session (by its hash: a client's key can be megabytes long) -> node of its last turn
        self.homes: OrderedDict[int, str] = OrderedDict()
        self.residency = Residency()
        # the prompt tokens from which a session is resident, on the nodes of the last decision
        # (commit follows its request's decision: only resident turns are counted)
        self.resident_from = math.inf

    def reweigh(self, w: CostWeights) -> None:
        self.ring = HashRing(c=w.affinity_load_bound)

    def home(
        self, request: RouteRequest, nodes: Sequence[NodeView], matches: Mapping[str, int]
    ) -> str | None:
        """The node that gets the session's affinity bonus: its last turn's node while it is a
        candidate and no other node holds more of this prompt; for a session never seen, the
        node of consistent hashing with bounded loads where no node holds any of the prompt."""
        session = request.session_id
        if session is None:
            return None
        home = self.homes.get(hash(session))
        if home is None and request.parent_session_id is not None:  # a subagent
            home = self.homes.get(hash(request.parent_session_id))
        longest = max(matches.values(), default=0)
        if home is None or not any(n.node_id == home for n in nodes):
            # the ring's node only where nothing holds any of the prompt: a node holding its
            # prefix is worth more than a node its hash names
            if longest:
                return None
            return self.ring.home(
                point(session), {n.node_id: float(n.running + n.waiting + n.pending) for n in nodes}
            )
        return None if matches.get(home, 0) < longest else home

    def resident(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
        over: Callable[[NodeView], bool],
        w: CostWeights,
        pace: Pace,
    ) -> tuple[int, str] | None:
        """A resident session's node (its index in ``nodes``) and reason: a later turn (or a
        subagent's first) kept on the node holding its context (``prefix_hit``), or moved off
        an overflow node whose queue is long (``session_move``); a first turn,
        or a turn whose context no node holds any more, placed where resident contexts leave
        room for it (``session_place``) or, where none does, on the node most committed
        (``session_overflow``: router/decision/residency.py); None where the cost decides.
        ``pace``: a node's queue and prefill as the cost counts them (the relief's)."""
        session = request.session_id
        if session is None:
            return None
        self.resident_from = Residency.threshold(w.resident_share, nodes, w.resident_tokens)
        if request.prompt_tokens < self.resident_from:
            return None
        self.residency.expire(now)
        key, parent = hash(session), request.parent_session_id
        if key in self.homes or (parent is not None and hash(parent) in self.homes):
            need = -(-request.prompt_tokens // nodes[0].block_size)
            kept = Residency.keep(nodes, matches, need, w.resident_hold)
            if kept is not None:
                moved = self.residency.relieve(
                    kept,
                    nodes,
                    matches,
                    over,
                    request.prompt_tokens,
                    key,
                    w.resident_fill,
                    w.resident_overflow_wait_s,
                    w.resident_move_gain,
                    pace,
                )
                if moved is not None:
                    return next(i for i, n in enumerate(nodes) if n is moved), "session_move"
                return next(i for i, n in enumerate(nodes) if n is kept), "prefix_hit"
        placed = self.residency.place(
            nodes,
            matches,
            over,
            request.prompt_tokens,
            w.resident_fill,
            key,
            wait_s=w.resident_overflow_wait_s,
            pace=pace,
        )
        if placed is None:
            return None
        node, overflowed = placed
        reason = "session_overflow" if overflowed else "session_place"
        return next(i for i, n in enumerate(nodes) if n is node), reason

    def commit(self, request: RouteRequest, node: str, now: float, w: CostWeights) -> None:
        """``request`` went to ``node``: the node of its session's last turn, and where its
        context lives."""
        if request.session_id is None:
            return
        session = hash(request.session_id)
        if w.session_affinity_s > 0 or w.resident_share > 0:
            homes = self.homes
            homes[session] = node
            homes.move_to_end(session)
            if len(homes) > SESSION_HOMES:
                homes.popitem(last=False)
        if request.prompt_tokens >= self.resident_from:
            self.residency.commit(session, node, request.prompt_tokens, now + w.resident_window_s)

    def paused(self, session_id: str, node: str, now: float, until: float, w: CostWeights) -> None:
        """A turn of ``session_id`` ended on ``node`` at ``now``, its prefix held there until
        ``until``: a resident session counts there for the window from its turn's end or for
        its hold, whichever is longer."""
        self.residency.pause(hash(session_id), node, max(until, now + w.resident_window_s))
