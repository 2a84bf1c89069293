"""Resident sessions: where long-context sessions live, so that their KV stays put.

A session whose prompt takes a large share of a node's KV (an agent's 50k–200k-token context on
a node that holds a few of them) is not routed like a chat turn. Its context is most of what
its node can hold: moving it recomputes the whole context elsewhere and evicts other sessions'
contexts there, whose next turns then miss and move in turn (measured on AIPerf's agentic trace,
``kvgate bench agentic``: a load-priced move per six later turns, every node holding pieces of
40 sessions, the hit rate 18 points under a cache-first router). Rules for requests whose
prompt needs at least ``resident_share`` of the node's KV blocks, or has ``resident_tokens``
tokens (on nodes with much KV a tenth is more than an agent's first turn: priced as a chat
turn, it is placed by the system prompt every session shares and piles onto its holders):

* **keeping** — a later turn goes to the node holding the longest prefix of its prompt whenever
  that node alone holds it that deep and it is at least ``resident_hold`` of the prompt, busy or
  not: the engine queues it behind the node's running turns, which free their KV within a turn,
  where a move would compute the whole context again. A node the fit or the fleet rules left
  out is not a candidate, so a holder that is draining, ejected or can never hold the context
  is still left;
* **placement** — a session's first turn (its first through this router), and a later one whose
  context no node holds any more (the deepest holding is a prefix every session shares, held by
  several nodes), goes where it has **room**: among the nodes not over their limits, those
  whose resident contexts and its prompt stay within ``resident_fill`` of the node's KV, the
  one whose resident contexts take the fewest tokens (ties to the node holding more of the
  prompt). A shared system prompt must not decide where a context that will grow to most of a
  node lives: placed by it, most sessions pile onto its holder;
* **overflow** — where no node has room, the session goes to the node most committed already.
  When the sessions alive need more KV than the cluster has (AIPerf's agentic trace with 80 of
  its sessions at once: up to three times), some contexts cannot be kept whatever the routing;
  an engine's LRU cycling through more contexts than it holds keeps none of them. Spreading the
  excess (by cost, or by room) puts every node in that cycle; sending it to the node already
  over keeps the others' contexts whole (measured: hit rate 0.79 → 0.90 on that trace, above
  the cache-first peer's 0.89, whose accident of routing does the same: the node its first
  turns go to holds the excess). The price is that node's queue: the TTFT tail is the overflow's;
* **relief** — so that queue is bounded (``resident_overflow_wait_s``): a session overflows only
  to a node whose queued prefill clears within the bound while any does (a second node joins
  the overflow), and a later turn kept on an overflow node whose queue is longer moves to the
  node a placement chooses among the others where it evicts nothing that would be kept (room
  for it, or overflowing already) and starts ``resident_move_gain`` × sooner
  (measured on that trace at 60–100 sessions at once, medians: TTFT p99 108 → 65 s against
  the tuned cache-first peer's 73, hit rate 0.907 → 0.882 against its 0.887). A node's queue
  is read as the cost reads it (:class:`Pace`): with several routers, each one's own backlog
  is only its share.

A session is resident on its node from its turn's routing until ``resident_window_s`` after it
(a turn whose end never comes back), and from its turn's end for the longer of that window and
its hold (the gap its kind of session pauses for, router/decision/turngap.py; the policy hears
of it through :meth:`Residency.pause`).

The policy keeps one :class:`Residency` (per router, as its session homes; the live router and
the simulator alike) and calls :meth:`Residency.commit` for every routed request of a session.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.decision.types import NodeView

__all__ = ["Pace", "Residency"]

RESIDENT_SESSIONS = 100_000  # sessions a router tracks (least recent go first)


class Pace(Protocol):
    """A node's prefill as the cost counts it (router/decision/policies/costmodel.py): the
    queue there — this router's own backlog, or the node's waiting requests (every router's)
    where they are more — and the time a prompt takes, at its learned or configured rate."""

    def queue_s(self, n: NodeView) -> float: ...

    def prefill_s(self, n: NodeView, tokens: float) -> float: ...


@dataclass(slots=True)
class _Resident:
    node: str
    tokens: int
    until: float  # it leaves its node's count then (unless a turn or a pause moves it)


class Residency:
    """Resident sessions by node: the tokens of their contexts, kept up to date as turns are
    routed, as turns end (the session pauses for its learned gap) and as sessions go quiet
    (a heap of ends: O(log n) a turn, never a scan on the request path)."""

    def __init__(self, limit: int = RESIDENT_SESSIONS) -> None:
        self._sessions: OrderedDict[int, _Resident] = OrderedDict()
        self._tokens: Counter[str] = Counter()
        self._ends: list[tuple[float, int]] = []
        self._limit = limit

    def __len__(self) -> int:
        return len(self._sessions)

    def tokens_on(self, node: str) -> int:
        return self._tokens[node]

    def by_node(self) -> dict[str, int]:
        return dict(self._tokens)

    @staticmethod
    def threshold(share: float, nodes: Sequence[NodeView], tokens: int = 0) -> float:
        """The prompt tokens from which a session is resident: ``share`` of the largest of
        ``nodes``' KV, or ``tokens`` where that is fewer (never, where ``share`` is 0 or there
        are no nodes)."""
        if share <= 0 or not nodes:
            return math.inf
        by_share = share * max(n.kv_blocks_total * n.block_size for n in nodes)
        return min(by_share, tokens) if tokens > 0 else by_share

    def expire(self, now: float) -> None:
        """Sessions whose time ran out leave their node's count: a turn whose end was never
        reported ``resident_window_s`` after it was routed, a paused session when its learned
        gap has passed."""
        ends, sessions = self._ends, self._sessions
        while ends and ends[0][0] <= now:
            until, session = heapq.heappop(ends)
            r = sessions.get(session)
            if r is not None and r.until == until:
                del sessions[session]
                self._drop(r)

    def place(
        self,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        over: Callable[[NodeView], bool],
        need_tokens: int,
        fill: float,
        session: int | None = None,
        *,
        wait_s: float = 0.0,
        pace: Pace | None = None,
    ) -> tuple[NodeView, bool] | None:
        """A session's node when it has none holding its context (a first turn, or a context
        lost), and whether it overflowed: among ``nodes`` not ``over`` their limits (all of
        them when every one is), the nodes with **room** — whose resident tokens (less
        ``session``'s own) and its ``need_tokens`` stay within ``fill`` × the node's KV —
        and of those the one with the fewest resident tokens, ties to the longest prefix held.
        Where no node has room (``fill`` 0: room is not asked), the session **overflows** to
        the node most committed already (resident tokens over its KV, then the longest prefix
        held): its contexts are being evicted anyway, and one more there evicts nothing that
        would have been kept, where on a node with room it would start the eviction cycle that
        leaves every node's contexts missing (an LRU cycling through more contexts than it
        holds keeps none of them). With ``wait_s`` and ``pace``, only a node whose queued
        prefill clears within it takes the overflow while any does: a second node joins the
        overflow when the first one's queue is long, where every session overflowing onto one
        node made that queue the tail."""
        pool = [n for n in nodes if not over(n)] or list(nodes)
        if not pool:
            return None
        tokens = self._tokens
        mine = self._sessions.get(session) if session is not None else None

        def held(n: NodeView) -> int:
            got = tokens[n.node_id]
            return got - mine.tokens if mine is not None and mine.node == n.node_id else got

        if fill > 0:
            room = [
                n for n in pool if held(n) + need_tokens <= fill * n.kv_blocks_total * n.block_size
            ]
            if not room:
                if wait_s > 0 and pace is not None:
                    pool = [n for n in pool if pace.queue_s(n) < wait_s] or pool
                top = max(
                    pool,
                    key=lambda n: (
                        held(n) / max(1, n.kv_blocks_total * n.block_size),
                        matches.get(n.node_id, 0),
                    ),
                )
                return top, True
            pool = room
        return min(pool, key=lambda n: (held(n), -matches.get(n.node_id, 0))), False

    def relieve(
        self,
        kept: NodeView,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        over: Callable[[NodeView], bool],
        prompt_tokens: int,
        session: int,
        fill: float,
        wait_s: float,
        gain: float,
        pace: Pace,
    ) -> NodeView | None:
        """Where a later turn :meth:`keep` sent to ``kept`` goes instead, if anywhere: only
        from a node over-committed (its resident contexts more than its KV: an overflow node)
        whose queued prefill takes longer than ``wait_s``, to the node :meth:`place` chooses
        among the others where it evicts no context that would be kept (nodes with room for
        it, and overflow nodes), where the turn would start ``gain`` × sooner — its whole
        prompt behind that node's queue against the part ``kept`` no longer holds behind
        ``kept``'s. The overflow node's queue is the TTFT tail; a session that leaves it for a
        node with room (or with a short queue) shortens that queue for every session that
        stays."""
        if wait_s <= 0 or self._tokens[kept.node_id] <= kept.kv_blocks_total * kept.block_size:
            return None
        queue_s = pace.queue_s(kept)
        if queue_s <= wait_s:
            return None
        held = min(prompt_tokens, matches.get(kept.node_id, 0) * kept.block_size)
        stay_s = queue_s + pace.prefill_s(kept, prompt_tokens - held)
        tokens = self._tokens

        def evicts_nothing_kept(n: NodeView) -> bool:  # room for it, or cycling already
            kv = n.kv_blocks_total * n.block_size
            return tokens[n.node_id] + prompt_tokens <= fill * kv or tokens[n.node_id] > kv

        others = [n for n in nodes if n is not kept and evicts_nothing_kept(n)]
        if not others:
            return None
        placed = self.place(
            others,
            matches,
            over,
            prompt_tokens,
            fill,
            session,
            wait_s=wait_s,
            pace=pace,
        )
        if placed is None:
            return None
        to = placed[0]
        go_s = pace.queue_s(to) + pace.prefill_s(to, prompt_tokens)
        return to if stay_s > gain * go_s else None

    @staticmethod
    def keep(
        nodes: Sequence[NodeView], matches: Mapping[str, int], need_blocks: int, hold: float
    ) -> NodeView | None:
        """A later turn's node: the candidate holding the longest prefix of its prompt, where
        that is at least ``hold`` of its ``need_blocks`` and held by that node alone. A prefix
        several nodes hold as deep is not the session's context but what sessions share (a
        system prompt, tools): its own context is gone (evicted), and the first of those
        holders in the node order would be a placement by accident."""
        best: NodeView | None = None
        depth = tied = 0
        for n in nodes:
            got = matches.get(n.node_id, 0)
            if got > depth:
                best, depth, tied = n, got, 0
            elif got == depth:
                tied += 1
        if best is None or tied or depth < hold * need_blocks:
            return None
        return best

    def commit(self, session: int, node: str, tokens: int, until: float) -> None:
        """``session``'s turn of ``tokens`` went to ``node``; it counts there until ``until``
        unless its end is reported (:meth:`pause`) or another turn comes first."""
        sessions = self._sessions
        r = sessions.get(session)
        if r is not None:
            self._drop(r)
            r.node, r.tokens, r.until = node, tokens, until
            sessions.move_to_end(session)
        else:
            sessions[session] = r = _Resident(node, tokens, until)
            if len(sessions) > self._limit:
                _, gone = sessions.popitem(last=False)
                self._drop(gone)
        self._tokens[node] += tokens
        self._push(until, session)

    def pause(self, session: int, node: str, until: float) -> None:
        """``session``'s turn on ``node`` ended: its context counts there until ``until`` (the
        end of its hold: the gap its kind of session pauses for, router/decision/turngap.py).
        A session that has moved since, or is not resident, is left as it is."""
        r = self._sessions.get(session)
        if r is None or r.node != node:
            return
        if until > r.until:
            r.until = until
            self._push(until, session)

    def _push(self, until: float, session: int) -> None:
        ends = self._ends
        heapq.heappush(ends, (until, session))
        if len(ends) > 4 * self._limit:  # stale entries: rebuild from the sessions
            self._ends = [(r.until, s) for s, r in self._sessions.items()]
            heapq.heapify(self._ends)

    def _drop(self, r: _Resident) -> None:
        left = self._tokens[r.node] - r.tokens
        if left > 0:
            self._tokens[r.node] = left
        else:
            del self._tokens[r.node]
