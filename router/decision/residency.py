"""Resident sessions: where long-context sessions live, so that their KV stays put.

A session whose prompt takes a large share of a node's KV (an agent's 50k–200k-token context on
a node that holds a few of them) is not routed like a chat turn. Its context is most of what
its node can hold: moving it recomputes the whole context elsewhere and evicts other sessions'
contexts there, whose next turns then miss and move in turn (measured on AIPerf's agentic trace,
``kvgate bench agentic``: a load-priced move per six later turns, every node holding pieces of
40 sessions, the hit rate 18 points under a cache-first router). Two rules, for requests whose
prompt needs at least ``resident_share`` of the node's KV blocks:

* **placement** — a session's first turn (its first through this router) goes to the node where
  the contexts of the sessions resident there — those with a turn in the last
  ``resident_window_s`` — take the fewest tokens, among the nodes not over their limits; ties go
  to the node holding more of the prompt. A shared system prompt (every session's first blocks)
  must not decide where a context that will grow to most of a node lives: placed by it, most
  sessions pile onto its holder;
* **keeping** — a later turn goes to the node holding the longest prefix of its prompt whenever
  that is at least ``resident_hold`` of the prompt, busy or not: the engine queues it behind the
  node's running turns, which free their KV within a turn, where a move would compute the whole
  context again. A node the fit or the fleet rules left out is not a candidate, so a holder that
  is draining, ejected or can never hold the context is still left.

The policy keeps one :class:`Residency` (per router, as its session homes; the live router and
the simulator alike) and calls :meth:`Residency.commit` for every routed request of a session.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from router.decision.types import NodeView

__all__ = ["Residency"]

RESIDENT_SESSIONS = 100_000  # sessions a router tracks (least recent go first)


@dataclass(slots=True)
class _Resident:
    node: str
    tokens: int
    seen: float


class Residency:
    """Resident sessions by node: the tokens of their contexts, kept up to date as turns are
    routed and as sessions go quiet (oldest first, amortized O(1) a turn)."""

    def __init__(self, limit: int = RESIDENT_SESSIONS) -> None:
        self._sessions: OrderedDict[int, _Resident] = OrderedDict()
        self._tokens: Counter[str] = Counter()
        self._limit = limit

    def __len__(self) -> int:
        return len(self._sessions)

    def tokens_on(self, node: str) -> int:
        return self._tokens[node]

    @staticmethod
    def threshold(share: float, nodes: Sequence[NodeView]) -> float:
        """The prompt tokens from which a session is resident: ``share`` of the largest of
        ``nodes``' KV (never, where ``share`` is 0 or there are no nodes)."""
        if share <= 0 or not nodes:
            return math.inf
        return share * max(n.kv_blocks_total * n.block_size for n in nodes)

    def expire(self, now: float, window_s: float) -> None:
        """Sessions without a turn for ``window_s`` leave their node's count."""
        sessions = self._sessions
        while sessions:
            r = next(iter(sessions.values()))
            if now - r.seen <= window_s:
                return
            sessions.popitem(last=False)
            self._drop(r)

    def place(
        self,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        over: Callable[[NodeView], bool],
    ) -> NodeView | None:
        """A new session's node: the fewest resident tokens among ``nodes`` not ``over``
        their limits (all of them when every one is), ties to the longest prefix held."""
        pool = [n for n in nodes if not over(n)] or list(nodes)
        if not pool:
            return None
        tokens = self._tokens
        return min(pool, key=lambda n: (tokens[n.node_id], -matches.get(n.node_id, 0)))

    @staticmethod
    def keep(
        nodes: Sequence[NodeView], matches: Mapping[str, int], need_blocks: int, hold: float
    ) -> NodeView | None:
        """A later turn's node: the candidate holding the longest prefix of its prompt, if that
        is at least ``hold`` of its ``need_blocks``."""
        best: NodeView | None = None
        depth = 0
        for n in nodes:
            got = matches.get(n.node_id, 0)
            if got > depth:
                best, depth = n, got
        return best if best is not None and depth >= hold * need_blocks else None

    def commit(self, session: int, node: str, tokens: int, now: float) -> None:
        """``session``'s turn of ``tokens`` went to ``node`` at ``now``."""
        sessions = self._sessions
        r = sessions.get(session)
        if r is not None:
            self._drop(r)
            r.node, r.tokens, r.seen = node, tokens, now
            sessions.move_to_end(session)
        else:
            sessions[session] = r = _Resident(node, tokens, now)
            if len(sessions) > self._limit:
                _, gone = sessions.popitem(last=False)
                self._drop(gone)
        self._tokens[node] += tokens

    def _drop(self, r: _Resident) -> None:
        left = self._tokens[r.node] - r.tokens
        if left > 0:
            self._tokens[r.node] = left
        else:
            del self._tokens[r.node]
