"""The router's own in-flight requests, per node: what heartbeats cannot show it yet.

* **Unreflected dispatches.** Between two heartbeats (~500 ms) a router that trusts the table
  alone sends a whole burst to the same "least loaded" node. A dispatch counts until a heartbeat
  newer than it arrives (the engine has seen the request) or the request finishes.
* **Prefill backlog.** Heartbeats count requests, not how long their prompts are. Until its first
  token comes back, a request's uncached prompt is prefill work still ahead of the node.

Entries leave on ``finish`` (always called, whatever the outcome) or after ``horizon_s``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["InflightLedger"]


@dataclass(slots=True)
class _Entry:
    node: str
    dispatched_s: float
    prefill_tokens: int
    prefilling: bool = True


@dataclass(slots=True)
class InflightLedger:
    horizon_s: float = 600.0
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _recent: dict[str, deque[tuple[float, str]]] = field(default_factory=dict)
    _backlog: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._entries)

    def dispatch(self, request_id: str, node: str, now: float, prefill_tokens: int) -> None:
        self._entries[request_id] = _Entry(node, now, prefill_tokens)
        self._recent.setdefault(node, deque()).append((now, request_id))
        self._backlog[node] = self._backlog.get(node, 0) + prefill_tokens

    def first_token(self, request_id: str) -> None:
        e = self._entries.get(request_id)
        if e is not None and e.prefilling:
            e.prefilling = False
            self._backlog[e.node] -= e.prefill_tokens

    def finish(self, request_id: str) -> None:
        self.first_token(request_id)
        self._entries.pop(request_id, None)

    def unreflected(self, node: str, heartbeat_ts: float) -> int:
        """This router's requests on ``node`` dispatched after its last heartbeat."""
        q = self._recent.get(node)
        if not q:
            return 0
        while q and q[0][0] <= heartbeat_ts:
            q.popleft()
        return sum(1 for _, rid in q if rid in self._entries)

    def prefill_backlog(self, node: str) -> int:
        """Uncached prompt tokens of this router's requests on ``node`` still awaiting prefill."""
        return self._backlog.get(node, 0)

    def sweep(self, now: float) -> int:
        """Drop entries older than the horizon (a lost ``finish`` must not grow the ledger)."""
        old = [rid for rid, e in self._entries.items() if now - e.dispatched_s > self.horizon_s]
        for rid in old:
            self.finish(rid)
        for q in self._recent.values():
            while q and now - q[0][0] > self.horizon_s:
                q.popleft()
        return len(old)
