"""The router's own dispatches that the load table does not show yet.

Between two heartbeats (~500 ms) a router that trusts the table alone sends a whole burst to the
same "least loaded" node. Each dispatch is remembered until the node's heartbeat is newer than it
(the engine has seen the request) or the request finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["PendingDispatches"]


@dataclass(slots=True)
class PendingDispatches:
    horizon_s: float = 5.0
    _by_node: dict[str, deque[tuple[float, str]]] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)

    def add(self, node: str, request_id: str, now: float) -> None:
        self._by_node.setdefault(node, deque()).append((now, request_id))

    def finish(self, request_id: str) -> None:
        self._done.add(request_id)

    def unreflected(self, node: str, heartbeat_ts: float, now: float) -> int:
        q = self._by_node.get(node)
        if not q:
            return 0
        while q and (q[0][0] <= heartbeat_ts or q[0][0] < now - self.horizon_s):
            self._done.discard(q.popleft()[1])
        return sum(1 for _, rid in q if rid not in self._done)
