"""Outlier ejection on what the router itself sees, with Envoy's outlier-detection semantics.

A node whose metrics look fine can still fail every request it gets (a broken engine behind a
healthy ``/metrics``, a wedged worker that accepts connections and never answers). The router
counts, per node, the outcome of every request it sent there:

* **consecutive errors** — 5xx answers, timeouts and connection errors (Envoy's
  ``consecutive_5xx`` with local-origin errors folded in, its default); ``consecutive_errors`` in a
  row eject the node. A 4xx is the client's doing and counts as a success, a client that went
  away counts as nothing;
* **success-rate outliers** — every ``interval_s``, among the nodes with at least
  ``success_rate_request_volume`` requests in the interval (and only when at least
  ``success_rate_minimum_hosts`` such nodes exist), a node whose success rate is below
  ``mean − success_rate_stdev_factor × stdev`` is ejected.

An ejected node gets no requests for ``base_ejection_time_s × multiplier`` (capped at
``max_ejection_time_s``); the multiplier grows by one per ejection and shrinks by one per
interval without one. When the time is up the node is *probing* (half-open): it takes at most one
request at a time until ``probe_successes`` succeed in a row (then it is back) or one fails (then
it is ejected again, for longer). At most ``max_ejection_percent`` of the nodes are ejected at
once — at least one — so a fault on the router's side cannot eject the whole fleet.

Each router keeps its own detector (as each Envoy does): no shared state, nothing to go stale.
Pure: time is passed in.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from router.decision.weights import OutlierSettings

__all__ = ["Failure", "NodeHealth", "OutlierDetector"]

Failure = Literal["5xx", "timeout", "connect"]


@dataclass(slots=True)
class NodeHealth:
    consecutive: int = 0
    multiplier: int = 0  # ejections not yet forgiven (one forgiven per quiet interval)
    ejected_until: float | None = None  # ejected while now < this
    probing: bool = False  # ejection over, not yet trusted again
    probe_sent_at: float | None = None  # the probe in flight (one at a time)
    probe_ok: int = 0
    ejections: int = 0  # all-time, for the metrics
    last_cause: str = ""
    ok_in_interval: int = 0
    total_in_interval: int = 0


@dataclass(slots=True)
class OutlierDetector:
    settings: OutlierSettings
    nodes: dict[str, NodeHealth] = field(default_factory=dict)
    _interval_start: float | None = None
    flagged: set[str] = field(default_factory=set)  # ejected or probing: the only ones to check
    ejections_total: dict[str, int] = field(default_factory=dict)  # cause -> count

    def _health(self, node: str) -> NodeHealth:
        h = self.nodes.get(node)
        if h is None:
            h = self.nodes[node] = NodeHealth()
        return h

    def ejected(self, now: float) -> set[str]:
        """Nodes that get no request now: ejected, or probing with a probe in flight."""
        self.tick(now)
        s = self.settings
        out = set()
        for node in list(self.flagged):
            h = self.nodes[node]
            if h.ejected_until is not None:
                if now < h.ejected_until:
                    out.add(node)
                    continue
                h.ejected_until, h.probing, h.probe_ok = None, True, 0
            if h.probing and h.probe_sent_at is not None:
                if now - h.probe_sent_at < s.probe_timeout_s:
                    out.add(node)
                else:  # the probe never reported back: it failed
                    self._eject(node, h, now, "probe_timeout", len(self.nodes))
                    out.add(node)
        return out

    def sent(self, node: str, now: float) -> None:
        """A request went to ``node`` (a probing node takes one at a time)."""
        h = self.nodes.get(node)
        if h is not None and h.probing:
            h.probe_sent_at = now

    def observe(self, node: str, failure: Failure | None, now: float, hosts: int) -> str | None:
        """The outcome of one request on ``node`` (``failure`` None: it succeeded) among
        ``hosts`` known nodes; returns the cause when this outcome ejected the node."""
        if not self.settings.enabled:
            return None
        self.tick(now)
        h = self._health(node)
        h.total_in_interval += 1
        if h.probing:
            h.probe_sent_at = None
            if failure is None:
                h.probe_ok += 1
                if h.probe_ok >= self.settings.probe_successes:
                    h.probing, h.consecutive = False, 0
                    self.flagged.discard(node)
                return None
            return self._eject(node, h, now, f"probe_{failure}", hosts)
        if h.ejected_until is not None and now < h.ejected_until:
            return None  # a request sent before the ejection: already counted
        if failure is None:
            h.ok_in_interval += 1
            h.consecutive = 0
            return None
        h.consecutive += 1
        if h.consecutive >= self.settings.consecutive_errors:
            return self._eject(node, h, now, f"consecutive_{failure}", hosts)
        return None

    def _eject(self, node: str, h: NodeHealth, now: float, cause: str, hosts: int) -> str | None:
        s = self.settings
        others = sum(
            1
            for n, o in self.nodes.items()
            if n != node and o.ejected_until is not None and now < o.ejected_until
        )
        if others + 1 > max(1, math.floor(hosts * s.max_ejection_percent / 100)):
            h.consecutive = 0  # over the cap: not ejected, counted afresh
            return None
        h.multiplier += 1
        h.ejected_until = now + min(s.max_ejection_time_s, s.base_ejection_time_s * h.multiplier)
        h.probing, h.probe_sent_at, h.probe_ok, h.consecutive = False, None, 0, 0
        self.flagged.add(node)
        h.ejections += 1
        h.last_cause = cause
        kind = cause.split("_", 1)[0] if cause.startswith("probe") else cause
        self.ejections_total[kind] = self.ejections_total.get(kind, 0) + 1
        return cause

    def tick(self, now: float) -> list[str]:
        """Close the analysis interval when it is over: success-rate outliers are ejected and
        quiet nodes are forgiven one ejection. Returns the nodes ejected by success rate."""
        s = self.settings
        if self._interval_start is None:
            self._interval_start = now
            return []
        if now - self._interval_start < s.interval_s:
            return []
        self._interval_start = now
        out = []
        volume = {
            n: h.ok_in_interval / h.total_in_interval
            for n, h in self.nodes.items()
            if h.total_in_interval >= s.success_rate_request_volume and h.ejected_until is None
        }
        if len(volume) >= s.success_rate_minimum_hosts:
            rates = list(volume.values())
            floor = statistics.fmean(rates) - s.success_rate_stdev_factor * statistics.pstdev(rates)
            for n in sorted(volume, key=volume.__getitem__):
                h = self.nodes[n]
                if volume[n] < floor and self._eject(n, h, now, "success_rate", len(self.nodes)):
                    out.append(n)
        for h in self.nodes.values():
            if h.ejected_until is None and not h.probing and h.multiplier > 0:
                h.multiplier -= 1
            h.ok_in_interval = h.total_in_interval = 0
        return out

    def forget(self, present: Iterable[str]) -> None:
        """Drop what is known of nodes that are gone (no state only grows)."""
        keep = set(present)
        for node in [n for n in self.nodes if n not in keep]:
            h = self.nodes[node]
            if h.ejected_until is None and not h.probing:
                del self.nodes[node]

    def state(self, now: float) -> dict[str, dict[str, object]]:
        """What ``/v1/kvgate/state`` shows: every node ejected, probing or with errors."""
        out: dict[str, dict[str, object]] = {}
        for node, h in sorted(self.nodes.items()):
            if h.ejected_until is not None and now < h.ejected_until:
                status = "ejected"
            elif h.probing or h.ejected_until is not None:
                status = "probing"
            elif h.consecutive or h.multiplier:
                status = "suspect"
            else:
                continue
            out[node] = {
                "status": status,
                "cause": h.last_cause,
                "ejections": h.ejections,
                "consecutive_errors": h.consecutive,
                "ejected_for_s": round(max(0.0, (h.ejected_until or now) - now), 3),
            }
        return out
