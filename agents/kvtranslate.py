"""Engine KV events → kvgate block hashes and net deltas (pure).

Engines hash blocks their own way; kvgate's router hashes prompts with :mod:`streams.blocks`. The
agent recomputes kvgate's chained hash of every stored block from the token ids that
``BlockStored`` carries, so the two sides cannot silently disagree. It keeps the node's current
set of blocks and, at each flush, emits only the net change since the last flush.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agents.vllm_events import (
    AllBlocksClearedMsg,
    BlockRemovedMsg,
    BlockStoredMsg,
    EngineHash,
    KVEventBatchMsg,
)
from streams.blocks import block_hash

__all__ = ["KvDelta", "KvTranslator"]


@dataclass(frozen=True, slots=True)
class KvDelta:
    stored: list[int]
    removed: list[int]
    cleared: bool

    @property
    def empty(self) -> bool:
        return not (self.stored or self.removed or self.cleared)


@dataclass(slots=True)
class KvTranslator:
    block_size: int
    _by_engine: dict[EngineHash, int] = field(default_factory=dict)  # engine -> kvgate hash
    _blocks: set[int] = field(default_factory=set)  # kvgate hashes the engine holds now
    _published: set[int] = field(default_factory=set)  # what consumers were last told
    _touched: set[int] = field(default_factory=set)
    _cleared: bool = False
    untranslatable_blocks: int = 0

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    @property
    def pending(self) -> int:
        return len(self._touched)

    def apply(self, batch: KVEventBatchMsg) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStoredMsg):
                self._stored(ev)
            elif isinstance(ev, BlockRemovedMsg):
                for eh in ev.block_hashes:
                    kh = self._by_engine.pop(eh, None)
                    if kh is not None:
                        self._blocks.discard(kh)
                        self._touched.add(kh)
            elif isinstance(ev, AllBlocksClearedMsg):
                self.reset()

    def reset(self) -> None:
        """Forget everything (engine cleared its cache or restarted)."""
        self._by_engine.clear()
        self._blocks.clear()
        self._published.clear()
        self._touched.clear()
        self._cleared = True

    def _stored(self, ev: BlockStoredMsg) -> None:
        bs = ev.block_size or self.block_size
        if ev.parent_block_hash is None:
            parent: int | None = None
        elif ev.parent_block_hash in self._by_engine:
            parent = self._by_engine[ev.parent_block_hash]
        else:  # the parent was never seen (events lost): cannot chain these blocks
            self.untranslatable_blocks += len(ev.block_hashes)
            return
        for i, eh in enumerate(ev.block_hashes):
            tokens = ev.token_ids[i * bs : (i + 1) * bs]
            if len(tokens) < bs:
                self.untranslatable_blocks += len(ev.block_hashes) - i
                return
            parent = block_hash(parent, tokens)
            self._by_engine[eh] = parent
            self._blocks.add(parent)
            self._touched.add(parent)

    def take_delta(self) -> KvDelta:
        """Net change since the previous call."""
        stored = [h for h in self._touched if h in self._blocks and h not in self._published]
        removed = [h for h in self._touched if h not in self._blocks and h in self._published]
        self._published.update(stored)
        self._published.difference_update(removed)
        delta = KvDelta(stored, removed, self._cleared)
        self._touched.clear()
        self._cleared = False
        return delta

    def snapshot(self) -> list[int]:
        """The full current set; consumers replace the node's entries with it."""
        self._touched.clear()
        self._cleared = False
        self._published = set(self._blocks)
        return list(self._blocks)
