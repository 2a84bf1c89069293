"""Which of the eligible nodes a request may go to: operator drains, canary shares, slow start of
new replicas and outlier ejection. One object per router (and per simulated cluster), so that
the live router and the simulator apply the same rules.

* **Drain** (``kvgate drain NODE``): no new requests; what runs there finishes, or, still
  streaming after ``router.drain_grace_s``, goes on from another node (router/loops.py).
* **Canary groups** (``kvgate canary GROUP --nodes A,B --share 0.05``): a fixed share of requests
  goes to the group's nodes and only that share; a request (its session, when it has one) falls
  in a group or not by a hash of its id, so every router splits the same way without talking.
* **Slow start** (Envoy's ``slow_start_window``): a replica that started less than ``window_s``
  ago, while established replicas of its model exist, is offered a request with probability
  ``max(min_weight, (age / window) ** (1 / aggression))`` — a fresh replica with an empty cache
  ramps up instead of taking full traffic at its first heartbeat. Replicas that start together
  (a new fleet) are not slowed: there is nothing to shift their traffic to.
* **Outlier ejection** (:mod:`router.decision.outlier`).

Nothing here ever empties the candidate list on its own: when a rule would leave no node, the
nodes it removed stay (the admission budget already refused what does not fit).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from router.decision.outlier import OutlierDetector
from router.decision.types import NodeView
from router.decision.weights import OutlierSettings, SlowStartSettings

__all__ = ["CanaryGroup", "Fleet", "Selection"]


def _unit(key: str) -> float:
    """A key's uniform position in [0, 1) (the same on every router)."""
    return zlib.crc32(key.encode()) / 2**32


@dataclass(frozen=True, slots=True)
class CanaryGroup:
    name: str
    nodes: frozenset[str]
    share: float  # of requests, in [0, 1]


@dataclass(frozen=True, slots=True)
class Selection:
    nodes: list[NodeView]
    ejected: tuple[str, ...] = ()  # eligible nodes left out because they are ejected
    canary: str | None = None  # the canary group the request fell in
    slowed: tuple[str, ...] = ()  # nodes in slow start left out of this request


@dataclass(slots=True)
class Fleet:
    outlier: OutlierSettings
    slow_start: SlowStartSettings
    detector: OutlierDetector = field(init=False)
    drained: set[str] = field(default_factory=set)
    canaries: dict[str, CanaryGroup] = field(default_factory=dict)
    _first_seen: dict[str, tuple[str, float]] = field(default_factory=dict)  # node -> (epoch, at)
    _latest_start: float | None = None  # the youngest start :meth:`started` has reported

    def __post_init__(self) -> None:
        self.detector = OutlierDetector(self.outlier)

    # --- operator state ------------------------------------------------------------------
    def set_canary(self, name: str, nodes: Iterable[str], share: float) -> None:
        group = CanaryGroup(name, frozenset(nodes), min(1.0, max(0.0, share)))
        if group.nodes and group.share > 0:
            self.canaries[name] = group
        else:
            self.canaries.pop(name, None)

    # --- slow start ----------------------------------------------------------------------
    def started(self, node: str, epoch: str, engine_started_at: float | None, now: float) -> float:
        """When ``node``'s engine started: its own start time when the agent reports it, else
        when this router first saw the node's current agent incarnation."""
        seen = self._first_seen.get(node)
        if seen is None or seen[0] != epoch:
            seen = self._first_seen[node] = (epoch, now)
        at = engine_started_at if engine_started_at is not None else seen[1]
        if self._latest_start is None or at > self._latest_start:
            self._latest_start = at
        return at

    def weight(self, view: NodeView, now: float, established: bool) -> float:
        """The share of requests a node in slow start is offered (1: not in slow start)."""
        s = self.slow_start
        if s.window_s <= 0 or view.started_at is None or not established:
            return 1.0
        age = now - view.started_at
        if age >= s.window_s:
            return 1.0
        ramp: float = (max(0.0, age) / s.window_s) ** (1.0 / s.aggression)
        return max(s.min_weight, ramp)

    # --- per request ---------------------------------------------------------------------
    def select(self, nodes: Sequence[NodeView], key: str, now: float) -> Selection:
        """The nodes a request (known by ``key``: its session or its id) may go to, among the
        eligible ``nodes``."""
        out = list(nodes)
        canary = None
        if self.canaries and out:
            out, canary = self._canary(out, key)
        slowed: tuple[str, ...] = ()
        if self.slow_start.window_s > 0 and len(out) > 1:
            out, slowed = self._slow(out, key, now)
        ejected: tuple[str, ...] = ()
        if self.outlier.enabled and self.detector.flagged and out:
            gone = self.detector.ejected(now)
            if gone:
                kept = [n for n in out if n.node_id not in gone]
                if kept:
                    ejected = tuple(n.node_id for n in out if n.node_id in gone)
                    out = kept
        return Selection(out, ejected, canary, slowed)

    def _canary(self, nodes: list[NodeView], key: str) -> tuple[list[NodeView], str | None]:
        u = _unit("canary|" + key)
        at = 0.0
        in_any: set[str] = set()
        for name in sorted(self.canaries):
            g = self.canaries[name]
            in_any |= g.nodes
            if at <= u < at + g.share:
                mine = [n for n in nodes if n.node_id in g.nodes]
                if mine:
                    return mine, name
            at += g.share
        rest = [n for n in nodes if n.node_id not in in_any]
        return (rest or nodes), None

    def _slow(
        self, nodes: list[NodeView], key: str, now: float
    ) -> tuple[list[NodeView], tuple[str, ...]]:
        window = self.slow_start.window_s
        if self._latest_start is not None and now - self._latest_start >= window:
            return nodes, ()  # no node started within the window (the hot path's usual case)
        young = [n for n in nodes if n.started_at is not None and now - n.started_at < window]
        if not young or len(young) == len(nodes):  # none new, or a fleet starting together
            return nodes, ()
        slowed = {
            n.node_id
            for n in young
            if _unit(f"slow|{n.node_id}|{key}") >= self.weight(n, now, True)
        }
        if not slowed:
            return nodes, ()
        return [n for n in nodes if n.node_id not in slowed], tuple(sorted(slowed))

    # --- outcomes ------------------------------------------------------------------------
    def reason(
        self, reason: str, chosen: str | None, sel: Selection, matches: Mapping[str, int]
    ) -> str:
        """The decision reason, marked ``ejected/`` when an ejected node held more of the
        prompt than the chosen one (the request went elsewhere because of the ejection)."""
        if not sel.ejected or chosen is None:
            return reason
        best = max(matches.get(n, 0) for n in sel.ejected)
        return f"ejected/{reason}" if best > matches.get(chosen, 0) else reason

    def forget(self, present: Iterable[str]) -> None:
        keep = set(present)
        self.detector.forget(keep)
        for node in [n for n in self._first_seen if n not in keep]:
            del self._first_seen[node]

    def counts(self, views: Sequence[NodeView], now: float) -> dict[str, int]:
        """How many of ``views`` are drained, ejected, probing, in slow start, in a canary."""
        health = self.detector.state(now)
        old = any(
            n.started_at is None or now - n.started_at >= self.slow_start.window_s for n in views
        )
        canary = set().union(*(g.nodes for g in self.canaries.values())) if self.canaries else set()
        return {
            "drained": sum(1 for v in views if v.node_id in self.drained),
            "ejected": sum(1 for h in health.values() if h["status"] == "ejected"),
            "probing": sum(1 for h in health.values() if h["status"] == "probing"),
            "slow_start": sum(1 for v in views if self.weight(v, now, old) < 1.0),
            "canary": sum(1 for v in views if v.node_id in canary),
        }

    def state(self, now: float) -> dict[str, object]:
        return {
            "drained": sorted(self.drained),
            "ejected": self.detector.state(now),
            "canaries": {
                g.name: {"nodes": sorted(g.nodes), "share": g.share} for g in self.canaries.values()
            },
        }
