"""The in-memory form of the prefix index: block hash → nodes, node → blocks.

Routers hold one, fed from the ``prefix_index`` changelog; the simulator holds one fed directly.
``match`` returns, per node, the length of the longest run of leading blocks it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["PrefixIndex"]


class PrefixIndex:
    __slots__ = ("_by_block", "_by_node")

    def __init__(self) -> None:
        self._by_block: dict[int, set[str]] = {}
        self._by_node: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    @property
    def entries(self) -> int:
        return sum(len(b) for b in self._by_node.values())

    def nodes(self) -> list[str]:
        return list(self._by_node)

    def blocks_of(self, node: str) -> set[int]:
        return set(self._by_node.get(node, ()))

    def blocks_view(self, node: str) -> frozenset[int] | set[int]:
        """The node's blocks without a copy: read it before changing the index."""
        return self._by_node.get(node) or frozenset()

    def add(self, node: str, block: int) -> None:
        self._by_block.setdefault(block, set()).add(node)
        self._by_node.setdefault(node, set()).add(block)

    def add_many(self, node: str, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.add(node, b)

    def remove(self, node: str, block: int) -> None:
        holders = self._by_block.get(block)
        if holders is not None:
            holders.discard(node)
            if not holders:
                del self._by_block[block]
        mine = self._by_node.get(node)
        if mine is not None:
            mine.discard(block)
            if not mine:
                del self._by_node[node]

    def drop_node(self, node: str) -> None:
        for block in self._by_node.pop(node, set()):
            holders = self._by_block.get(block)
            if holders is not None:
                holders.discard(node)
                if not holders:
                    del self._by_block[block]

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per node, how many leading blocks of ``hashes`` it holds (nodes with 0 omitted)."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._by_block.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for n in alive:
                out[n] = i + 1
        return out
