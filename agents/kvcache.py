"""A paged KV cache of fixed-size blocks with prefix reuse and LRU eviction (pure, no I/O).

Blocks are either *anonymous* (being filled, or holding a partial block) or *cached* under the
chained hash of their content. A cached block with no reference stays reusable until it is
evicted in least-recently-used order, like vLLM's prefix cache. Every change that an outside
observer can see is returned as a :class:`CacheEvent` so that the engine can publish it.

A request released with a retention hint (``hold_until``: an agent session between turns)
leaves its blocks *held*: unreferenced and reusable like any cached block, but evicted only when
no ordinary unreferenced block is left — a hold yields to running work, it never makes an
allocation fail — and ordinary again once its time is past (:meth:`KvCache.expire`). Among
held blocks the least recently released go first, as in the LRU: a hold's end says how long
to protect a session, not which session returns first (ordered by their ends, the holds given
while the router's learned bound moved evicted newer sessions before older ones).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

__all__ = ["AllCleared", "BlockRemoved", "BlockStored", "CacheEvent", "KvCache", "OutOfBlocks"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    lora_name: str | None = None  # the adapter of the request that computed them
    cache_salt: str | None = None  # its salt, when the first block is the request's first


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


CacheEvent = BlockStored | BlockRemoved | AllCleared


class OutOfBlocks(Exception):
    """Not enough free or evictable blocks."""


@dataclass(slots=True)
class KvCache:
    num_blocks: int
    block_size: int
    _refs: dict[int, int] = field(default_factory=dict)  # cached hash -> references
    _lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # unreferenced, cached
    _held: dict[int, float] = field(default_factory=dict)  # unreferenced, held until a time
    _soonest: float = float("inf")  # no hold ends before this
    _anon: int = 0  # anonymous blocks in use
    events: list[CacheEvent] = field(default_factory=list)

    # --- observation ---------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        """Blocks that cannot be handed out without breaking a running request."""
        return self._anon + len(self._refs) - len(self._lru) - len(self._held)

    @property
    def held_blocks(self) -> int:
        """Unreferenced blocks kept for a session between its turns."""
        return len(self._held)

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    @property
    def free_blocks(self) -> int:
        """Blocks available to a new allocation (empty or evictable)."""
        return self.num_blocks - self.used_blocks

    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    def cached_hashes(self) -> list[int]:
        return list(self._refs)

    def match_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` present in the cache."""
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n

    def can_allocate(self, new_blocks: int, reuse: Sequence[int] = ()) -> bool:
        """Whether ``new_blocks`` fresh blocks fit after referencing the cached ``reuse``."""
        pinned = sum(1 for h in reuse if h in self._lru or h in self._held)
        return self.free_blocks - pinned >= new_blocks

    # --- mutation ------------------------------------------------------------------------
    def acquire(self, hashes: Sequence[int]) -> None:
        """Reference cached blocks (a prefix hit)."""
        for h in hashes:
            self._refs[h] += 1
            self._lru.pop(h, None)
            self._held.pop(h, None)

    def allocate(self, n: int) -> None:
        """Take ``n`` anonymous blocks, evicting unreferenced cached blocks (LRU) if needed."""
        if n > self.free_blocks:
            raise OutOfBlocks(f"need {n} blocks, {self.free_blocks} free")
        empty = self.num_blocks - self._anon - len(self._refs)
        evict = max(0, n - empty)
        if evict:
            removed = []
            for _ in range(min(evict, len(self._lru))):
                h, _ = self._lru.popitem(last=False)
                del self._refs[h]
                removed.append(h)
            if len(removed) < evict:  # holds yield: the least recently released go first
                for h in list(islice(self._held, evict - len(removed))):
                    del self._held[h]
                    del self._refs[h]
                    removed.append(h)
            self.events.append(BlockRemoved(tuple(removed)))
        self._anon += n

    def commit(
        self,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        lora: str | None = None,
        salt: str | None = None,
    ) -> None:
        """Turn ``len(hashes)`` filled anonymous blocks into cached, referenced blocks.

        A hash already cached (another request computed the same block) keeps the existing
        block and frees the duplicate. ``lora`` / ``salt``: the request's adapter and
        ``cache_salt`` (they are in its hashes; events name them as the engine does).
        """
        new: list[int] = []
        for h in hashes:
            self._anon -= 1
            if h in self._refs:
                self._refs[h] += 1
                self._lru.pop(h, None)
                self._held.pop(h, None)
            else:
                self._refs[h] = 1
                new.append(h)
        if new:
            if len(new) == len(hashes):
                first_salt = salt if parent is None else None
                self.events.append(
                    BlockStored(tuple(new), parent, tuple(token_ids), lora, first_salt)
                )
            else:  # rare: split so that each event's tokens match its blocks
                bs = self.block_size
                prev = parent
                for i, h in enumerate(hashes):
                    if h in new:
                        toks = tuple(token_ids[i * bs : (i + 1) * bs])
                        first_salt = salt if prev is None else None
                        self.events.append(BlockStored((h,), prev, toks, lora, first_salt))
                    prev = h

    def commit_each(self, blocks: Sequence[tuple[int, int | None]]) -> None:
        """:meth:`commit` of one block per request for several requests: ``(hash, parent)``
        pairs, each a filled anonymous block of a different request."""
        refs = self._refs
        events = self.events
        self._anon -= len(blocks)
        for h, parent in blocks:
            if h in refs:
                refs[h] += 1
                self._lru.pop(h, None)
                self._held.pop(h, None)
            else:
                refs[h] = 1
                events.append(BlockStored((h,), parent, ()))

    def release(
        self, hashes: Sequence[int], anonymous: int, hold_until: float | None = None
    ) -> None:
        """Drop a request's references; its cached blocks become evictable, most recent last
        (``hold_until``: held until then, see the module's docstring)."""
        for h in reversed(hashes):  # the tail of a prefix is evicted before its head
            left = self._refs[h] - 1
            self._refs[h] = left
            if left == 0:
                if hold_until is None:
                    self._lru[h] = None
                else:
                    self._held[h] = hold_until
                    self._soonest = min(self._soonest, hold_until)
        self._anon -= anonymous

    def expire(self, now: float) -> int:
        """Holds past their time become ordinary unreferenced blocks (the most recently used
        end of the LRU order); returns how many."""
        if now < self._soonest:
            return 0
        due = [h for h, until in self._held.items() if until <= now]
        for h in due:
            del self._held[h]
            self._lru[h] = None
        self._soonest = min(self._held.values(), default=float("inf"))
        return len(due)

    def clear(self) -> bool:
        """Drop every cached block, like vLLM's reset_prefix_cache: only when none is in use."""
        if self.used_blocks:
            return False
        self._refs.clear()
        self._lru.clear()
        self._held.clear()
        self.events.append(AllCleared())
        return True

    def drain_events(self) -> list[CacheEvent]:
        out, self.events = self.events, []
        return out
