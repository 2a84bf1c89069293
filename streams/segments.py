"""The prefix index changelog as per-node segments: a cost per batch, not per block.

Each node's cached blocks are written as

* a **base**: the node's whole block set, in parts of at most :data:`PART_BLOCKS` blocks (keys
  ``<node>|b0``, ``<node>|b1``, …), written under a new *generation*;
* then at most :data:`SLOTS` **deltas** (keys ``<node>|d0`` … ``<node>|d15``): the blocks stored
  and removed since the previous record, coalesced over one commit interval.

Every record carries the node's KV cursor (the last batch folded into it). A new base is written
when the slots are used up, when the deltas since the base add up to more than the base (so that
a reader never folds more than about twice the node's size) or when a batch replaced the node's
cache (a snapshot, ``cleared``). Slot keys are reused, so a compacted changelog holds at most
``parts + SLOTS`` records per node; a slot still holding an older generation is ignored.

Readers fold the records in changelog order (:func:`fold_segment`); the worker, restoring from
its table (a dict, no order), folds a node's base parts and then its deltas by slot
(:func:`restore_node`). Both give the state the writer had when it wrote the last record.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field

from streams.folds import KvCursor, KvPlan

__all__ = [
    "BASE",
    "DELTA",
    "PART_BLOCKS",
    "SLOTS",
    "NodeSegments",
    "Segment",
    "SegmentState",
    "fold_segment",
    "group_records",
    "parse_segment_key",
    "read_segment",
    "restore_node",
    "segment_key",
]

BASE, DELTA = "b", "d"
SLOTS = 16
PART_BLOCKS = 65_536  # 512 KiB of hashes per base record: under Kafka's default 1 MiB message limit
MIN_REBASE = 1_024  # deltas may add up to this many entries before a small node is rebased
MAX_PARTS = 4_096  # base parts a reader accepts (268 million blocks): a hostile key or record
# must not make a reader or a retiring worker walk billions of keys

_MAGIC = b"KS1"
_HEAD = struct.Struct("<3sBIIIqHII")  # magic, kind, gen, index, parts, seq, len(epoch), n+, n-
_KINDS = {BASE: 0, DELTA: 1}
_KIND_OF = {0: BASE, 1: DELTA}
_MAX_EPOCH = 1_000


def segment_key(node: str, kind: str, index: int) -> bytes:
    return f"{node}|{kind}{index}".encode()


def parse_segment_key(key: bytes) -> tuple[str, str, int]:
    """(node, kind, index) of a segment key; ValueError when it is not one."""
    node, sep, tail = key.decode().rpartition("|")
    if not sep or not node or len(tail) < 2 or tail[0] not in _KINDS:
        raise ValueError(f"not a segment key: {key!r}")
    index = int(tail[1:])
    if index < 0 or index >= (SLOTS if tail[0] == DELTA else MAX_PARTS):
        raise ValueError(f"segment index out of range: {key!r}")
    return node, tail[0], index


@dataclass(frozen=True, slots=True)
class Segment:
    """One record: a base part (``index`` = part number of ``parts``) or a delta (``index`` =
    slot). ``removed`` is empty in a base."""

    kind: str
    gen: int
    index: int
    parts: int
    cursor: KvCursor
    stored: array[int]
    removed: array[int]

    def encode(self) -> bytes:
        epoch = self.cursor.epoch.encode()
        head = _HEAD.pack(
            _MAGIC,
            _KINDS[self.kind],
            self.gen,
            self.index,
            self.parts,
            self.cursor.seq,
            len(epoch),
            len(self.stored),
            len(self.removed),
        )
        return head + epoch + self.stored.tobytes() + self.removed.tobytes()

    @classmethod
    def decode(cls, raw: bytes) -> Segment:
        """ValueError on anything that is not a well-formed segment."""
        if len(raw) < _HEAD.size:
            raise ValueError("segment record too short")
        magic, kind, gen, index, parts, seq, n_epoch, n_st, n_rm = _HEAD.unpack_from(raw)
        if magic != _MAGIC or kind not in _KIND_OF or n_epoch > _MAX_EPOCH or seq < 0:
            raise ValueError("not a segment record")
        if parts > MAX_PARTS or index >= (MAX_PARTS if kind == _KINDS[BASE] else SLOTS):
            raise ValueError("segment part or slot out of range")
        start = _HEAD.size + n_epoch
        if len(raw) != start + 8 * (n_st + n_rm):
            raise ValueError("segment record length does not match its counts")
        body = array("q")
        body.frombytes(raw[start:])
        stored, removed = body[:n_st], body[n_st:]
        return cls(
            _KIND_OF[kind],
            gen,
            index,
            parts,
            KvCursor(raw[_HEAD.size : start].decode(), seq),
            stored,
            removed,
        )


@dataclass(slots=True)
class SegmentState:
    """What a reader needs to fold one node's records in order."""

    gen: int = 0
    parts: int = 0  # parts of the current base
    parts_seen: int = 0
    cursor: KvCursor | None = None


def fold_segment(
    state: SegmentState, current: Set[int], seg: Segment
) -> tuple[list[int], list[int]] | None:
    """(upserts, deletes) that bring a node's blocks ``current`` to what ``seg`` says, in
    changelog order; None when the record is stale (an older generation's slot or part)."""
    if seg.kind == BASE:
        if seg.index == 0:  # a new base: it replaces the node's blocks
            state.gen, state.parts, state.parts_seen = seg.gen, seg.parts, 1
            state.cursor = seg.cursor
            keep = set(seg.stored)
            return [h for h in keep if h not in current], [h for h in current if h not in keep]
        if seg.gen != state.gen or seg.index != state.parts_seen:
            return None
        state.parts_seen += 1
        state.cursor = seg.cursor
        return [h for h in seg.stored if h not in current], []
    if seg.gen != state.gen or state.parts_seen < state.parts:
        return None
    state.cursor = seg.cursor
    return (
        [h for h in seg.stored if h not in current],
        [h for h in seg.removed if h in current],
    )


def restore_node(records: Mapping[tuple[str, int], Segment]) -> tuple[set[int], SegmentState, int]:
    """One node's blocks, fold state and next free slot from its records as a table holds them
    (keyed by (kind, index), in no order): the base's parts, then its generation's deltas by
    slot."""
    blocks: set[int] = set()
    state = SegmentState()
    first = records.get((BASE, 0))
    if first is None:
        return blocks, state, 0
    fold_segment(state, blocks, first)
    blocks.update(first.stored)
    for i in range(1, first.parts):
        part = records.get((BASE, i))
        if part is None or fold_segment(state, blocks, part) is None:
            break
        blocks.update(part.stored)
    next_slot = 0
    for slot in range(SLOTS):
        seg = records.get((DELTA, slot))
        if seg is None or seg.gen != state.gen:
            break
        changes = fold_segment(state, blocks, seg)
        if changes is None:
            break
        blocks.difference_update(changes[1])
        blocks.update(changes[0])
        next_slot = slot + 1
    return blocks, state, next_slot


@dataclass(slots=True)
class NodeSegments:
    """The worker's view of one node: its blocks, its last folded cursor, the changes not yet
    written, and where its next record goes."""

    partition: int
    blocks: set[int] = field(default_factory=set)
    cursor: KvCursor | None = None
    gen: int = 0
    next_slot: int = 0
    parts: int = 0  # base parts whose keys hold this generation (or an older one)
    since_base: int = 0  # delta entries written since the base
    added: set[int] = field(default_factory=set)  # in blocks, not in what was written
    dropped: set[int] = field(default_factory=set)  # written, no longer in blocks
    rebase: bool = False
    dirty: bool = False

    @classmethod
    def restored(cls, partition: int, records: Mapping[tuple[str, int], Segment]) -> NodeSegments:
        blocks, state, next_slot = restore_node(records)
        parts = max((i for kind, i in records if kind == BASE), default=-1) + 1
        node = cls(partition, blocks, state.cursor, state.gen, next_slot, parts)
        node.since_base = sum(
            len(records[(DELTA, s)].stored) + len(records[(DELTA, s)].removed)
            for s in range(next_slot)
        )
        return node

    def apply(self, plan: KvPlan, replaced: bool) -> None:
        """Fold a batch's plan (``replaced``: a snapshot or ``cleared``: write a new base)."""
        blocks, added, dropped = self.blocks, self.added, self.dropped
        for h in plan.deletes:
            blocks.discard(h)
            _note(h, added, dropped)
        for h in plan.upserts:
            blocks.add(h)
            _note(h, dropped, added)
        self.cursor = plan.cursor
        self.rebase = self.rebase or replaced
        self.dirty = True

    def flush(self, node: str) -> list[tuple[bytes, bytes | None]]:
        """The records that write the changes since the last flush (none when there are none),
        as (key, value or tombstone) in the order they must be written."""
        if not self.dirty or self.cursor is None:
            return []
        self.dirty = False
        changes = len(self.added) + len(self.dropped)
        out: list[tuple[bytes, bytes | None]] = []
        if (
            self.rebase
            or self.gen == 0
            or self.next_slot >= SLOTS
            or self.since_base + changes > max(len(self.blocks), MIN_REBASE)
        ):
            self.gen += 1
            ordered = sorted(self.blocks)
            parts = max(1, -(-len(ordered) // PART_BLOCKS))
            for i in range(parts):
                chunk = array("q", ordered[i * PART_BLOCKS : (i + 1) * PART_BLOCKS])
                seg = Segment(BASE, self.gen, i, parts, self.cursor, chunk, array("q"))
                out.append((segment_key(node, BASE, i), seg.encode()))
            # parts an older, larger base left behind: gone (readers would ignore them anyway)
            out.extend((segment_key(node, BASE, i), None) for i in range(parts, self.parts))
            self.parts, self.next_slot, self.since_base = parts, 0, 0
        else:
            seg = Segment(
                DELTA,
                self.gen,
                self.next_slot,
                0,
                self.cursor,
                array("q", self.added),
                array("q", self.dropped),
            )
            out.append((segment_key(node, DELTA, self.next_slot), seg.encode()))
            self.next_slot += 1
            self.since_base += changes
        self.added.clear()
        self.dropped.clear()
        self.rebase = False
        return out

    def tombstones(self, node: str) -> list[tuple[bytes, bytes | None]]:
        """Every key this node's records may occupy, deleted (the node retired)."""
        keys = [segment_key(node, BASE, i) for i in range(max(1, self.parts))]
        keys += [segment_key(node, DELTA, s) for s in range(SLOTS)]
        return [(k, None) for k in keys]


def _note(block: int, cancels: set[int], otherwise: set[int]) -> None:
    """Record a change not yet written: it cancels the opposite unwritten change, or joins its
    own kind (a block stored and evicted within one interval is never written)."""
    if block in cancels:
        cancels.discard(block)
    else:
        otherwise.add(block)


def group_records(
    items: Iterable[tuple[bytes, bytes]],
    on_bad: Callable[[bytes, ValueError], None] | None = None,
) -> dict[str, dict[tuple[str, int], Segment]]:
    """A table's segment records by node; records that do not parse are left out (and handed to
    ``on_bad`` with the reason, if given)."""
    out: dict[str, dict[tuple[str, int], Segment]] = {}
    for key, value in items:
        try:
            node, seg = read_segment(key, value)
        except ValueError as exc:
            if on_bad is not None:
                on_bad(key, exc)
            continue
        out.setdefault(node, {})[(seg.kind, seg.index)] = seg
    return out


def read_segment(key: bytes, value: bytes) -> tuple[str, Segment]:
    """(node, segment) of one record; ValueError when the key or the value is not a segment's,
    or they disagree on its kind or index."""
    node, kind, index = parse_segment_key(key)
    seg = Segment.decode(value)
    if seg.kind != kind or seg.index != index:
        raise ValueError(f"the record's kind or index is not its key's: {key!r}")
    return node, seg
