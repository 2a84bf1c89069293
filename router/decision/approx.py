"""An approximate prefix index for nodes that publish no KV events (e.g. SGLang without them).

The router remembers, per such node, the prompt blocks it had that node prefill — an LRU as large
as the node's KV cache — and treats them as cached. It cannot see evictions, other routers'
traffic or a cleared cache, so every hit from here is marked approximate in the decision record.
Each router replica keeps its own (it learns from its own decisions only).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["ApproxIndex"]


@dataclass(slots=True)
class ApproxIndex:
    _nodes: dict[str, OrderedDict[int, None]] = field(default_factory=dict)

    def add(self, node: str, hashes: Sequence[int], capacity_blocks: int) -> None:
        """``node`` computed (and so caches) the blocks ``hashes``; it holds at most
        ``capacity_blocks``, least recently used first out."""
        lru = self._nodes.setdefault(node, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > max(0, capacity_blocks):
            lru.popitem(last=False)

    def nodes(self) -> list[str]:
        """The nodes it remembers anything of."""
        return list(self._nodes)

    def match(self, hashes: Sequence[int], nodes: Iterable[str]) -> dict[str, int]:
        """Per node of ``nodes``, how many leading blocks of ``hashes`` it is believed to hold."""
        out: dict[str, int] = {}
        for node in nodes:
            lru = self._nodes.get(node)
            if not lru:
                continue
            n = 0
            for h in hashes:
                if h not in lru:
                    break
                n += 1
            if n:
                out[node] = n
        return out

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)

    def blocks(self, node: str) -> int:
        return len(self._nodes.get(node, ()))
