"""Pure folds of input events into table entries: idempotent, guarded by per-node sequences.

A replay after a crash re-delivers events the tables already hold; these functions decide from the
stored cursor (epoch, seq) whether an event is new, and turn a KV batch into idempotent upserts
and deletes keyed by (node, block). Nothing is incremented in place.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from streams.schemas import Heartbeat, KvEventBatch

__all__ = [
    "KvCursor",
    "KvPlan",
    "heartbeat_is_newer",
    "is_newer",
    "plan_kv",
]


@dataclass(frozen=True, slots=True)
class KvCursor:
    """The last KV batch applied for one node."""

    epoch: str
    seq: int

    def encode(self) -> bytes:
        return f"{self.epoch}/{self.seq}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> KvCursor:
        epoch, _, seq = raw.decode().rpartition("/")
        return cls(epoch, int(seq))


@dataclass(frozen=True, slots=True)
class KvPlan:
    apply: bool
    upserts: list[int]
    deletes: list[int]
    gap: bool  # batches were lost between the cursor and this one
    cursor: KvCursor


def is_newer(prev: tuple[str, int] | None, key: tuple[str, int]) -> bool:
    """Whether the message with (epoch, seq) ``key`` comes after ``prev`` from the same node."""
    return prev is None or key > prev


def heartbeat_is_newer(prev: Heartbeat | None, hb: Heartbeat) -> bool:
    return is_newer(None if prev is None else (prev.epoch, prev.seq), (hb.epoch, hb.seq))


def plan_kv(cursor: KvCursor | None, current: Set[int], batch: KvEventBatch) -> KvPlan:
    """What applying ``batch`` to a node whose entries are ``current`` changes."""
    new_cursor = KvCursor(batch.epoch, batch.seq)
    if cursor is not None and (batch.epoch, batch.seq) <= (cursor.epoch, cursor.seq):
        return KvPlan(False, [], [], False, cursor)
    if cursor is None or batch.epoch != cursor.epoch:
        gap = batch.kind != "snapshot"
    else:
        gap = batch.seq != cursor.seq + 1 and batch.kind != "snapshot"
    if batch.kind == "snapshot":
        keep = set(batch.stored)
        deletes = [h for h in current if h not in keep]
        upserts = [h for h in batch.stored if h not in current]
    elif batch.cleared:
        deletes = list(current)
        upserts = list(set(batch.stored))
    else:
        deletes = [h for h in set(batch.removed) if h in current]
        upserts = [h for h in set(batch.stored) if h not in current]
    return KvPlan(True, upserts, deletes, gap, new_cursor)
