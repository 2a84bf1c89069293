"""The in-memory form of the prefix index: block hash → holder nodes, node → blocks.

Routers hold one, fed from the ``prefix_index`` changelog; the simulator holds one fed directly.
``match`` returns, per node, the length of the longest run of leading blocks it holds.

Holders are a bit mask over node slots (one Python int per block), so that matching a prompt is
a chain of integer ANDs whatever the number of nodes, and a block costs one dict entry plus one
set entry (its node's block set, which snapshot resyncs and retirement need).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["PrefixIndex"]


class PrefixIndex:
    __slots__ = ("_by_block", "_by_node", "_free_slots", "_names", "_slot")

    def __init__(self) -> None:
        self._by_block: dict[int, int] = {}  # block hash -> bit mask of holder slots
        self._by_node: dict[str, set[int]] = {}
        self._slot: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free_slots: list[int] = []

    def __len__(self) -> int:
        return len(self._by_block)

    @property
    def entries(self) -> int:
        """(node, block) pairs indexed."""
        return sum(len(b) for b in self._by_node.values())

    def nodes(self) -> list[str]:
        return list(self._by_node)

    def blocks_of(self, node: str) -> set[int]:
        return set(self._by_node.get(node, ()))

    def blocks_view(self, node: str) -> frozenset[int] | set[int]:
        """The node's blocks without a copy: read it before changing the index."""
        return self._by_node.get(node) or frozenset()

    def _bit(self, node: str) -> int:
        slot = self._slot.get(node)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._names[slot] = node
            else:
                slot = len(self._names)
                self._names.append(node)
            self._slot[node] = slot
        return 1 << slot

    def add(self, node: str, block: int) -> None:
        self.add_many(node, (block,))

    def add_many(self, node: str, blocks: Iterable[int]) -> None:
        bit = self._bit(node)
        mine = self._by_node.get(node)
        if mine is None:
            mine = self._by_node[node] = set()
        by_block = self._by_block
        for b in blocks:
            by_block[b] = by_block.get(b, 0) | bit
            mine.add(b)

    def remove(self, node: str, block: int) -> None:
        self.remove_many(node, (block,))

    def remove_many(self, node: str, blocks: Iterable[int]) -> None:
        slot = self._slot.get(node)
        if slot is None:
            return
        keep = ~(1 << slot)
        by_block = self._by_block
        mine = self._by_node.get(node)
        for b in blocks:
            mask = by_block.get(b)
            if mask is not None:
                mask &= keep
                if mask:
                    by_block[b] = mask
                else:
                    del by_block[b]
            if mine is not None:
                mine.discard(b)
        if not mine:
            self._release(node)

    def drop_node(self, node: str) -> None:
        mine = self._by_node.get(node)
        if mine is not None:
            self.remove_many(node, list(mine))
        self._release(node)

    def _release(self, node: str) -> None:
        self._by_node.pop(node, None)
        slot = self._slot.pop(node, None)
        if slot is not None:
            self._names[slot] = None
            self._free_slots.append(slot)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per node, how many leading blocks of ``hashes`` it holds (nodes with 0 omitted)."""
        out: dict[str, int] = {}
        by_block = self._by_block
        alive = -1  # every slot
        depth = 0
        for h in hashes:
            mask = by_block.get(h, 0) & alive
            if mask != alive and depth:
                self._credit(alive & ~mask, depth, out)
            if not mask:
                return out
            alive = mask
            depth += 1
        if depth:
            self._credit(alive, depth, out)
        return out

    def match_tiers(
        self, hashes: Sequence[int], copy_of: Callable[[int], int]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Per node: the leading blocks of ``hashes`` it holds (as :meth:`match`), and how many
        of the blocks right after those it holds as copies (``copy_of(h)``: the same block's key
        in an offloaded tier): the prefix an engine reuses from its GPU cache, then loads from
        CPU or disk instead of computing. Nodes with 0 omitted. Only the runs that can exist are
        walked: from 0 for nodes without a GPU hit (one lookup when nobody has a copy of the
        first block), from its GPU prefix for each node with one."""
        gpu = self.match(hashes)
        n = len(hashes)
        if not n:
            return gpu, {}
        by_block, slots = self._by_block, self._slot
        starts: dict[int, int] = {}  # position -> slots whose offloaded run would start there
        gpu_bits = 0
        for name, g in gpu.items():
            bit = 1 << slots[name]
            gpu_bits |= bit
            if g < n:
                starts[g] = starts.get(g, 0) | bit
        cold = by_block.get(copy_of(hashes[0]), 0) & ~gpu_bits
        if cold:
            starts[0] = starts.get(0, 0) | cold
        tier: dict[str, int] = {}
        for start, alive in starts.items():
            i = start
            while alive and i < n:
                held = by_block.get(copy_of(hashes[i]), 0) & alive
                if held != alive and i > start:
                    self._credit(alive & ~held, i - start, tier)
                alive = held
                i += 1
            if alive and i > start:
                self._credit(alive, i - start, tier)
        return gpu, tier

    def _credit(self, mask: int, depth: int, out: dict[str, int]) -> None:
        names = self._names
        while mask:
            low = mask & -mask
            name = names[low.bit_length() - 1]
            if name is not None:
                out[name] = depth
            mask ^= low
