"""Table writes that wait for the commit: the last value per key per commit interval
(streams/app.py writes the worker's tables through it; streams/faustcommit.py sends its
outbox)."""

from __future__ import annotations

from typing import Any

__all__ = ["CoalescedTable"]


class CoalescedTable:
    """A Faust table whose writes wait for the next commit, the last value per key.

    A key written ten times in one commit interval costs one changelog record; a key set and
    deleted in the same interval, none. Writes go to the changelog partition given (the input
    partition of the node or reservation, as Faust's own writes do) and to the table's
    in-memory store, which is what recovery restores and :meth:`items` reads. The changelog
    records are left in ``outbox``, which the commit sends in one batch per partition
    (:func:`streams.faustcommit.send_table_records`) before it commits."""

    def __init__(self, table: Any, outbox: list[tuple[str, int, bytes, bytes | None]]) -> None:
        self.table = table
        self.outbox = outbox
        self.pending: dict[bytes, tuple[int, bytes | None]] = {}

    def get(self, key: bytes) -> bytes | None:
        if key in self.pending:
            return self.pending[key][1]
        value: bytes | None = self.table.data.get(key)
        return value

    def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        self.pending[key] = (partition, value)

    def items(self) -> list[tuple[bytes, bytes]]:
        """What the table holds (written records; pending writes are not included)."""
        return list(self.table.data.items())

    def partition_of(self, key: bytes) -> int:
        """The changelog partition a restored key came from (-1: not known)."""
        parts = getattr(self.table.data, "_key_partition", {})
        return int(parts.get(key, -1))

    def write(self, owned: set[int]) -> int:
        """Send the pending writes of the partitions this worker's consumer holds (the
        partitions whose offsets a commit now carries) and apply them to the store; the others
        stay pending until the partition is back or :meth:`drop` discards them."""
        store = self.table.data
        data = store.data
        topic = self.table.changelog_topic.get_topic_name()
        parts = getattr(store, "_key_partition", None)
        sent = 0
        kept: dict[bytes, tuple[int, bytes | None]] = {}
        for key, (partition, value) in self.pending.items():
            if partition not in owned:
                kept[key] = (partition, value)
                continue
            if value is None:
                if key not in data:  # never written: nothing to delete
                    continue
                del data[key]
                if parts is not None:
                    parts.pop(key, None)
            else:
                data[key] = value
                if parts is not None:
                    parts[key] = partition
            self.outbox.append((topic, partition, key, value))
            sent += 1
        self.pending = kept
        return sent

    def rewrite(self, owned: set[int]) -> None:
        """Write again, at the next commit, every entry the store holds for ``owned``
        partitions (pending writes win)."""
        for key, value in self.table.data.items():
            partition = self.partition_of(key)
            if partition in owned and key not in self.pending:
                self.pending[key] = (partition, value)

    def drop(self, owned: set[int]) -> None:
        """Forget pending writes of partitions this worker lost in a rebalance (their new owner
        folds that input again from the committed offsets)."""
        self.pending = {k: v for k, v in self.pending.items() if v[0] in owned}
