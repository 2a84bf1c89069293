"""Which input records the worker has folded, per partition: the offsets it may commit.

Faust decides what to commit from the records its streams *acknowledged*, and around a
rebalance it acknowledges records that no agent folded: a record a stream takes while the flow
is suspended, or whose consumer generation is stale, is skipped *and acked*; a jump in the
fetched offsets (records cleared from a stream buffer, a fetch racing a seek) is taken for a
compaction gap and committed over. Its commit then moves past input the tables never saw, and the
worker that takes the partition over resumes after it: KV batches are lost for good.

The worker therefore folds each input partition strictly in offset order and commits what it
folded, not what Faust acked (:func:`streams.faustpatch.commit_folded_offsets`). A record that
arrives past the next expected offset reveals a *hole*: it is not folded, and the partition is
read again from the hole once the broker has said what the first record at that offset is
(records that do not exist there, such as transaction markers or aborted records, are then
stepped over). Records already folded are not folded twice. A hole at the end of a partition has
no later record to reveal it: a partition the consumer handed out past what was folded, and from
which nothing arrived for a while, is read again too (:meth:`Frontier.quiet`; a partition that is
merely behind has handed nothing out past it).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Frontier", "Verdict"]

TP = TypeVar("TP")


class Verdict(enum.Enum):
    FOLD = "fold"  # the next record: fold it
    SKIP = "skip"  # folded already, or a re-read of the hole is under way: drop it
    HOLE = "hole"  # records before it were never delivered: ask the broker, then read again


@dataclass(slots=True)
class _Partition:
    done: int  # every record below this offset was folded (or does not exist)
    seen_at: float  # when a record of this partition last arrived
    asked_at: float | None = None  # when the hole at ``done`` was last reported


class Frontier(Generic[TP]):
    """Per input partition, the offset below which every record was folded.

    ``retry_s`` bounds how often one hole is reported: records that were fetched before the
    partition was read again still arrive for a while and are dropped meanwhile; if the re-read
    did not take (Faust can drop re-fetched records below its read offset), the hole is reported
    again after ``retry_s``."""

    def __init__(self, retry_s: float = 2.0) -> None:
        self.retry_s = retry_s
        self.parts: dict[TP, _Partition] = {}

    def reset(self) -> None:
        """Forget every partition (after a rebalance: each starts again from its committed
        offset, which the next record's ``committed`` gives)."""
        self.parts.clear()

    def observe(self, tp: TP, offset: int, committed: int | None, now: float) -> Verdict:
        """What to do with the record at ``offset``. ``committed`` is the partition's committed
        offset, used when the partition is seen for the first time since :meth:`reset` (None: it
        never had one, and the first record delivered starts it)."""
        part = self.parts.get(tp)
        if part is None:
            part = self.parts[tp] = _Partition(offset if committed is None else committed, now)
        part.seen_at = now
        if offset < part.done:
            return Verdict.SKIP
        if offset == part.done:
            part.done += 1
            part.asked_at = None
            return Verdict.FOLD
        if part.asked_at is not None and now - part.asked_at < self.retry_s:
            return Verdict.SKIP
        part.asked_at = now
        return Verdict.HOLE

    def next_offset(self, tp: TP) -> int | None:
        part = self.parts.get(tp)
        return None if part is None else part.done

    def resolve(self, tp: TP, offset: int, first: int | None) -> tuple[bool, int | None]:
        """After a :attr:`Verdict.HOLE` for the record at ``offset``: the broker's first record
        at or after the hole is at ``first`` (None: it could not say). Returns (fold the record
        now, offset to read the partition again from)."""
        part = self.parts[tp]
        if first is not None and part.done < first <= offset:
            part.done = first  # nothing exists between: step over it
        if part.done == offset:
            part.done += 1
            part.asked_at = None
            return True, None
        return False, part.done

    def track(self, tp: TP, committed: int, now: float) -> None:
        """Start following an assigned partition from its committed offset before any of its
        records arrived (so that :meth:`quiet` sees it even if none ever does)."""
        if tp not in self.parts:
            self.parts[tp] = _Partition(committed, now)

    def quiet(self, now: float, ends: Mapping[TP, int | None]) -> list[tuple[TP, int]]:
        """Partitions whose ``ends`` (the offset after the last record the consumer handed out
        to the agents) are past what was folded and from which nothing arrived for
        ``retry_s``, with the offset to ask the broker about; each is reported at most once per
        ``retry_s``."""
        out = []
        for tp, part in self.parts.items():
            end = ends.get(tp)
            if end is None or end <= part.done or now - part.seen_at < self.retry_s:
                continue
            if part.asked_at is not None and now - part.asked_at < self.retry_s:
                continue
            part.asked_at = now
            out.append((tp, part.done))
        return out

    def step_to(self, tp: TP, first: int) -> int:
        """The broker's first record at or after the partition's next offset is at ``first``
        (after :meth:`quiet`): nothing exists before it. Returns the offset to read from."""
        part = self.parts[tp]
        part.done = max(part.done, first)
        return part.done

    def offsets(self) -> dict[TP, int]:
        """The offset to commit per partition: the next record not folded."""
        return {tp: part.done for tp, part in self.parts.items()}

    def forget(self, keep: set[TP]) -> None:
        """Drop the partitions not in ``keep`` (no longer assigned)."""
        for tp in [tp for tp in self.parts if tp not in keep]:
            del self.parts[tp]
