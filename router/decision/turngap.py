"""Agent sessions between their turns (pure, no I/O): how long each kind of session pauses, and
which sessions are paused now with KV worth keeping.

An agent's turn ends with a tool call; the tool runs for seconds to minutes; the next turn
resends the whole conversation. :class:`TurnGaps` learns, per tenant and model, the gap
between the end of a session's turn and the start of its next one (online: an exponentially
decayed histogram of log-spaced buckets, recent sessions weighing most) and answers the bound a
hold should last: a high quantile of the gaps, with a margin, within limits. Before it has seen
enough gaps it answers a default.

:class:`PausedSessions` holds the sessions between turns: where their prefix is (the node that
served the turn), how many blocks it takes, until when it is worth keeping. A hold is soft: it
names KV kvgate asks the engine to keep, not a reservation — nothing is refused for it, and the
engine lets admitted work evict it. It ends when the session's next turn arrives (the session
runs again), or when its bound passes (the session has outlived what its kind usually pauses).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["Hold", "PausedSessions", "TurnGaps"]

MIN_GAP_S, MAX_GAP_S = 0.05, 3600.0  # gaps outside are not learned
_BUCKETS = 48  # log-spaced over [MIN_GAP_S, MAX_GAP_S]
_LOG_SPAN = math.log(MAX_GAP_S / MIN_GAP_S)


def _bucket(gap_s: float) -> int:
    return min(_BUCKETS - 1, int(math.log(gap_s / MIN_GAP_S) / _LOG_SPAN * _BUCKETS))


def _upper(bucket: int) -> float:
    """The largest gap of ``bucket``."""
    return MIN_GAP_S * math.exp((bucket + 1) / _BUCKETS * _LOG_SPAN)


@dataclass(slots=True)
class _Gaps:
    weights: list[float] = field(default_factory=lambda: [0.0] * _BUCKETS)
    total: float = 0.0
    seen: int = 0


@dataclass(slots=True)
class TurnGaps:
    """Inter-turn gaps per (tenant, model), and the end of each session's last turn."""

    quantile: float = 0.9
    margin: float = 1.25  # the bound: the quantile's gap × this
    min_samples: int = 8  # fewer gaps seen: the default bound
    default_s: float = 60.0
    floor_s: float = 2.0
    ceiling_s: float = 600.0
    decay: float = 0.995  # each new gap weighs the older ones down by this
    max_sessions: int = 100_000  # sessions whose last turn's end is remembered (LRU)
    max_kinds: int = 4_096  # (tenant, model) pairs learned
    _ends: OrderedDict[str, tuple[tuple[str, str], float]] = field(default_factory=OrderedDict)
    _kinds: OrderedDict[tuple[str, str], _Gaps] = field(default_factory=OrderedDict)
    fall_per_s: float = 0.1  # how fast the holds given may shorten (see hold_s)
    # per kind: when the last hold was given, and its length (see hold_s)
    _last: OrderedDict[tuple[str, str], tuple[float, float]] = field(default_factory=OrderedDict)

    def ended(self, session: str, kind: tuple[str, str], now: float) -> None:
        """A turn of ``session`` ended at ``now``."""
        self._ends[session] = (kind, now)
        self._ends.move_to_end(session)
        while len(self._ends) > self.max_sessions:
            self._ends.popitem(last=False)

    def began(self, session: str, kind: tuple[str, str], now: float) -> float | None:
        """A turn of ``session`` arrived at ``now``: the gap since its last turn ended (learned
        for ``kind``), None for a session's first turn (or one forgotten)."""
        last = self._ends.pop(session, None)
        if last is None or last[0] != kind:
            return None
        gap = now - last[1]
        if MIN_GAP_S <= gap <= MAX_GAP_S:
            g = self._kinds.get(kind)
            if g is None:
                g = self._kinds[kind] = _Gaps()
                while len(self._kinds) > self.max_kinds:
                    self._kinds.popitem(last=False)
            self._kinds.move_to_end(kind)
            g.weights = [w * self.decay for w in g.weights]
            g.weights[_bucket(gap)] += 1.0
            g.total = g.total * self.decay + 1.0
            g.seen += 1
        return gap

    def bound(self, kind: tuple[str, str]) -> float:
        """How long a paused session of ``kind`` is worth holding for."""
        g = self._kinds.get(kind)
        if g is None or g.seen < self.min_samples:
            return self.default_s
        target, acc = self.quantile * g.total, 0.0
        for b, w in enumerate(g.weights):
            acc += w
            if acc >= target:
                return min(self.ceiling_s, max(self.floor_s, _upper(b) * self.margin))
        return self.ceiling_s

    def hold_s(self, kind: tuple[str, str], now: float) -> float:
        """How long a hold of ``kind`` given at ``now`` lasts: :meth:`bound`, kept from falling
        faster than :attr:`fall_per_s` seconds per second since the last hold given. The learned
        bound moves (a default before enough gaps, then with the gaps); had each hold taken it
        as it was, a session paused later could end its hold well before one paused earlier,
        and an engine evicting ended holds first would evict the newer session before the older
        — an LRU turned around (in the agentic simulation: 4 points of hit rate). Holds
        that end in about the order they began keep the engine's order among sessions its LRU's,
        while the bound still follows the gaps down (and up at once)."""
        b = self.bound(kind)
        last = self._last.get(kind)
        if last is not None:
            at, given = last
            b = max(b, min(self.ceiling_s, given - self.fall_per_s * max(0.0, now - at)))
        self._last[kind] = (now, b)
        self._last.move_to_end(kind)
        while len(self._last) > self.max_kinds:
            self._last.popitem(last=False)
        return b

    def report(self) -> dict[str, dict[str, float | int]]:
        """Per "tenant/model": the gaps seen and the bound."""
        return {
            f"{t}/{m}": {"gaps_seen": g.seen, "bound_s": round(self.bound((t, m)), 2)}
            for (t, m), g in self._kinds.items()
        }


@dataclass(frozen=True, slots=True)
class Hold:
    session: str
    node: str
    blocks: int
    until: float


@dataclass(slots=True)
class PausedSessions:
    """Sessions between turns whose prefix kvgate asked an engine to keep. Expiry pops a heap
    of ends (O(log n) a hold, never a scan on the request path); an entry whose session has
    resumed or paused again since is skipped."""

    max_holds: int = 100_000
    _holds: OrderedDict[str, Hold] = field(default_factory=OrderedDict)
    _ends: list[tuple[float, str]] = field(default_factory=list)

    def pause(self, hold: Hold) -> None:
        self._holds[hold.session] = hold
        self._holds.move_to_end(hold.session)
        heapq.heappush(self._ends, (hold.until, hold.session))
        while len(self._holds) > self.max_holds:
            self._holds.popitem(last=False)
        if len(self._ends) > 2 * self.max_holds:  # stale entries: rebuild from the live holds
            self._ends = [(h.until, h.session) for h in self._holds.values()]
            heapq.heapify(self._ends)

    def resume(self, session: str, now: float) -> Hold | None:
        """The session's next turn arrived: its hold ends (the hold, if it was still on)."""
        hold = self._holds.pop(session, None)
        return hold if hold is not None and hold.until > now else None

    def expire(self, now: float) -> list[Hold]:
        """Holds whose bound passed: the sessions outlived what their kind pauses."""
        gone = []
        while self._ends and self._ends[0][0] <= now:
            until, session = heapq.heappop(self._ends)
            hold = self._holds.get(session)
            if hold is not None and hold.until == until:
                del self._holds[session]
                gone.append(hold)
        return gone

    def __len__(self) -> int:
        return len(self._holds)

    def blocks_by_node(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self._holds.values():
            out[h.node] = out.get(h.node, 0) + h.blocks
        return out
