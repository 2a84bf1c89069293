"""Each node's heartbeat load as the cost policy counts it: an EWMA per node of its running and
waiting requests and its KV blocks in use, so that noisy samples do not make decisions
ping-pong (pure). A node's average moves once per heartbeat a decision looks at: after a quiet
spell the first decision sees a share ``alpha`` of the change since the last one it saw."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.decision.types import NodeView

__all__ = ["LoadSmoother", "SmoothedLoad"]


@dataclass(slots=True)
class SmoothedLoad:
    heartbeat_ts: float
    running: float
    waiting: float
    kv_used: float


@dataclass(slots=True)
class LoadSmoother:
    _by_node: dict[str, SmoothedLoad] = field(default_factory=dict)

    def __getitem__(self, node_id: str) -> SmoothedLoad:
        """The load last smoothed for ``node_id``."""
        return self._by_node[node_id]

    def of(self, n: NodeView, alpha: float) -> SmoothedLoad:
        """``n``'s smoothed load, moved by ``alpha`` toward its view when the view carries a
        newer heartbeat than the last one seen."""
        s = self._by_node.get(n.node_id)
        if s is None:
            s = SmoothedLoad(n.heartbeat_ts, n.running, n.waiting, n.kv_blocks_used)
            self._by_node[n.node_id] = s
        elif n.heartbeat_ts > s.heartbeat_ts:
            s.heartbeat_ts = n.heartbeat_ts
            s.running += alpha * (n.running - s.running)
            s.waiting += alpha * (n.waiting - s.waiting)
            s.kv_used += alpha * (n.kv_blocks_used - s.kv_used)
        return s
