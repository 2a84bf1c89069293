"""The prefix index's segment layout: whatever batches a node sends and whenever the worker
writes, a reader folding the changelog in order, a reader of the compacted log, a router
bootstrapping from either (last record per key) and the worker restoring from its table all hold
the worker's blocks and cursor."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.folds import KvCursor, plan_kv
from streams.replica import TableReplica
from streams.schemas import KvEventBatch
from streams.segments import (
    BASE,
    DELTA,
    MIN_REBASE,
    PART_BLOCKS,
    SLOTS,
    NodeSegments,
    Segment,
    SegmentState,
    fold_segment,
    group_records,
    parse_segment_key,
    segment_key,
)
from streams.settings import KafkaSettings, WorkerSettings

NODE = "node|a"  # a node id with the separator in it


def batch(seq: int, stored: list[int], removed: list[int] = [], **kw: object) -> KvEventBatch:  # noqa: B006
    return KvEventBatch(
        node_id=NODE,
        epoch="e1",
        seq=seq,
        ts=1.0,
        block_size=16,
        stored=stored,
        removed=removed,
        **kw,
    )


class Log:
    """A changelog: every record in order, and what compaction keeps (the last per key)."""

    def __init__(self) -> None:
        self.records: list[tuple[bytes, bytes | None]] = []

    def write(self, records: list[tuple[bytes, bytes | None]]) -> None:
        self.records += records

    def compacted(self) -> list[tuple[bytes, bytes | None]]:
        last = {key: i for i, (key, _) in enumerate(self.records)}
        return [r for i, r in enumerate(self.records) if last[r[0]] == i and r[1] is not None]

    def table(self) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        for key, value in self.records:
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
        return out


def read_in_order(records: list[tuple[bytes, bytes | None]]) -> tuple[set[int], KvCursor | None]:
    blocks: set[int] = set()
    state = SegmentState()
    for key, value in records:
        node, kind, index = parse_segment_key(key)
        assert node == NODE
        if value is None:
            if (kind, index) == (BASE, 0):
                blocks, state = set(), SegmentState()
            continue
        changes = fold_segment(state, blocks, Segment.decode(value))
        if changes is not None:
            blocks.difference_update(changes[1])
            blocks.update(changes[0])
    return blocks, state.cursor


def restored(log: Log) -> NodeSegments:
    return NodeSegments.restored(0, group_records(log.table().items()).get(NODE, {}))


def bootstrapped(records: list[tuple[bytes, bytes | None]]) -> tuple[set[int], KvCursor | None]:
    """What a router's replica holds after bootstrapping from ``records`` (it keeps the last
    record per key, then restores each node as the worker does)."""
    r = TableReplica(KafkaSettings(), WorkerSettings(), "t")
    apply = r._bootstrap_apply()
    for key, value in records:
        apply(r.index_topic, key, value, 1.0)
    r._bootstrap_done(1.0)
    return r.index.blocks_of(NODE), r.cursors.get(NODE)


def check(writer: NodeSegments, log: Log) -> None:
    for records in (log.records, log.compacted()):
        assert read_in_order(records) == (writer.blocks, writer.cursor)
        assert bootstrapped(records) == (writer.blocks, writer.cursor)
    back = restored(log)
    assert (back.blocks, back.cursor, back.gen, back.next_slot) == (
        writer.blocks,
        writer.cursor,
        writer.gen,
        writer.next_slot,
    )


ops = st.lists(
    st.tuples(
        st.sampled_from(["delta", "delta", "delta", "snapshot", "cleared"]),
        st.lists(st.integers(0, 60), max_size=12),
        st.lists(st.integers(0, 60), max_size=12),
        st.booleans(),  # write (a commit) after this batch
        st.booleans(),  # a worker restarts from its table after this write
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops)
def test_readers_and_a_restarted_worker_hold_what_the_worker_folded(
    ops: list[tuple[str, list[int], list[int], bool, bool]],
) -> None:
    writer, log, seq = NodeSegments(0), Log(), 0
    for kind, stored, removed, write, restart in ops:
        seq += 1
        b = batch(
            seq,
            stored,
            removed,
            kind="snapshot" if kind == "snapshot" else "delta",
            cleared=kind == "cleared",
        )
        plan = plan_kv(writer.cursor, writer.blocks, b)
        writer.apply(plan, replaced=b.kind == "snapshot" or b.cleared)
        if write:
            log.write(writer.flush(NODE))
            check(writer, log)
            if restart:  # the successor goes on from the table alone
                writer = restored(log)
    log.write(writer.flush(NODE))
    check(writer, log)


def test_a_commit_interval_costs_one_record_per_node_and_cancels_what_came_and_went() -> None:
    writer, log = NodeSegments(0), Log()
    writer.apply(plan_kv(None, set(), batch(1, [1, 2, 3])), replaced=False)
    log.write(writer.flush(NODE))
    seq = 1
    for n in range(2, 12):  # ten batches in one interval: 100 stored, 99 of them evicted again
        seq += 1
        plan = plan_kv(writer.cursor, writer.blocks, batch(seq, [n * 10 + i for i in range(10)]))
        writer.apply(plan, replaced=False)
        evict = tuple(h for h in writer.blocks if h >= 20 and h != 115)
        seq += 1
        writer.apply(plan_kv(writer.cursor, writer.blocks, batch(seq, [], evict)), False)
    records = writer.flush(NODE)
    assert len(records) == 1
    key, value = records[0]
    assert key == segment_key(NODE, DELTA, 0) and value is not None
    seg = Segment.decode(value)
    assert list(seg.stored) == [115] and list(seg.removed) == []
    assert writer.flush(NODE) == []  # nothing new: nothing written
    log.write(records)
    check(writer, log)


def test_slots_are_reused_and_a_new_base_is_written_when_they_run_out() -> None:
    writer, log = NodeSegments(0), Log()
    for seq in range(1, 3 * SLOTS):
        writer.apply(plan_kv(writer.cursor, writer.blocks, batch(seq, [seq])), replaced=False)
        log.write(writer.flush(NODE))
    keys = {key for key, _ in log.compacted()}
    assert keys <= {segment_key(NODE, BASE, 0)} | {
        segment_key(NODE, DELTA, s) for s in range(SLOTS)
    }
    assert writer.gen == 3  # bases at the first write and after each 16 deltas
    check(writer, log)


def test_deltas_adding_up_to_more_than_the_node_rebase_it() -> None:
    writer = NodeSegments(0)
    writer.apply(plan_kv(None, set(), batch(1, [1])), replaced=False)
    writer.flush(NODE)
    many = list(range(2, MIN_REBASE // 2 + 100))
    writer.apply(plan_kv(writer.cursor, writer.blocks, batch(2, many)), False)
    assert [k for k, _ in writer.flush(NODE)] == [segment_key(NODE, DELTA, 0)]
    writer.apply(plan_kv(writer.cursor, writer.blocks, batch(3, [], tuple(many))), False)
    # the deltas would now hold ~1,200 entries for a node of one block: a new base instead
    assert [k for k, _ in writer.flush(NODE)] == [segment_key(NODE, BASE, 0)]
    assert writer.gen == 2 and writer.next_slot == 0


def test_a_large_base_is_split_into_parts_and_a_smaller_one_deletes_the_extra_parts() -> None:
    writer, log = NodeSegments(0), Log()
    big = list(range(1, PART_BLOCKS * 2 + 10))
    writer.apply(plan_kv(None, set(), batch(1, big)), replaced=False)
    records = writer.flush(NODE)
    log.write(records)
    assert [k for k, _ in records] == [segment_key(NODE, BASE, i) for i in range(3)]
    check(writer, log)
    writer.apply(plan_kv(writer.cursor, writer.blocks, batch(2, [5], kind="snapshot")), False)
    records = writer.flush(NODE)
    log.write(records)
    assert [(k, v is None) for k, v in records] == [
        (segment_key(NODE, BASE, 0), False),
        (segment_key(NODE, BASE, 1), True),
        (segment_key(NODE, BASE, 2), True),
    ]
    check(writer, log)


def test_retirement_deletes_every_key_and_a_returning_node_starts_over() -> None:
    writer, log = NodeSegments(0), Log()
    for seq in range(1, 6):
        writer.apply(plan_kv(writer.cursor, writer.blocks, batch(seq, [seq])), replaced=False)
        log.write(writer.flush(NODE))
    log.write(writer.tombstones(NODE))
    assert log.compacted() == [] and read_in_order(log.records) == (set(), None)
    again = NodeSegments(0)
    again.apply(plan_kv(None, set(), batch(1, [42])), replaced=False)
    log.write(again.flush(NODE))
    check(again, log)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"KS1",
        Segment("d", 1, 0, 0, KvCursor("e", 1), array("q", [1]), array("q")).encode()[:-1],
        Segment("d", 1, 16, 0, KvCursor("e", 1), array("q"), array("q")).encode(),
        Segment("b", 1, 0, 2**32 - 1, KvCursor("e", 1), array("q"), array("q")).encode(),
    ],
)
def test_a_record_that_is_not_a_segment_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        Segment.decode(raw)


@pytest.mark.parametrize(
    "key", [b"n1", b"n1|x0", b"n1|d16", b"n1|d-1", b"|b0", b"n1|b", b"n1|b4096", b"n1|b99999999"]
)
def test_a_key_that_is_not_a_segment_key_is_refused(key: bytes) -> None:
    with pytest.raises(ValueError):
        parse_segment_key(key)
