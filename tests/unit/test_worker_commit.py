"""The worker's exactly-once commit waits for the table writes buffered before it
(streams.faustcommit.flush_before_transaction_commit), and only for those; a write that fails
refuses the commit. Faust's own producer buffer runs here, with a slow sender standing for
aiokafka. The table records a commit writes leave in one batch per partition, and leave even
when no offset moved."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from faust.transport.consumer import Consumer, TransactionManager
from faust.transport.producer import ProducerBuffer
from faust.types import TP

from streams.faustcommit import (
    UnsentTableWrite,
    commit_on_a_fixed_cadence,
    commit_transactions_together,
    flush_before_transaction_commit,
    send_table_records,
    table_records_sent,
    write_tables_before_commit,
)

CONF = SimpleNamespace(producer_threaded=False, id="kvgate-worker")


class _Write(asyncio.Future[None]):
    """A buffered table write: how long aiokafka takes to accept it, and whether it fails."""

    def __init__(self, name: str, send_s: float, fails: bool = False) -> None:
        super().__init__()
        self.name, self.send_s, self.fails = name, send_s, fails


class _Buffer(ProducerBuffer):
    """Faust's buffer (its queue and its sender task); only the hand-off to Kafka is slow."""

    sent: list[str]

    async def _send_pending(self, fut: Any) -> None:
        await asyncio.sleep(fut.send_s)
        if fut.fails:
            fut.set_exception(ConnectionError("broker gone"))
            return
        self.sent.append(fut.name)
        fut.set_result(None)


class _Producer:
    def __init__(self, buffer: _Buffer) -> None:
        self.app = SimpleNamespace(conf=CONF)
        self.buffer = buffer
        self.committed_with: list[list[str]] = []

    async def commit_transactions(self, by_id: Any, group_id: str, **_: Any) -> None:
        self.committed_with.append(list(self.buffer.sent))


@pytest.fixture
async def parts() -> AsyncIterator[tuple[TransactionManager, _Producer, _Buffer]]:
    flush_before_transaction_commit(timeout_s=2.0)
    flush_before_transaction_commit()  # idempotent: wrapped once
    assert getattr(TransactionManager.commit, "flushes_first", False)
    buffer = _Buffer()
    buffer.app = SimpleNamespace(conf=CONF)  # type: ignore[assignment]
    buffer.sent = []
    producer = _Producer(buffer)
    app = SimpleNamespace(
        conf=CONF, assignor=SimpleNamespace(group_for_topic=lambda topic: 0), producer=producer
    )
    tm = TransactionManager(SimpleNamespace(app=app), consumer=None, producer=producer)  # type: ignore[arg-type]
    await buffer.start()
    try:
        yield tm, producer, buffer
    finally:
        await buffer.stop()


OFFSETS = {TP("kvgate.kv-events", 0): 42}


async def test_a_transaction_commits_after_the_table_writes_buffered_before_it(
    parts: tuple[TransactionManager, _Producer, _Buffer],
) -> None:
    tm, producer, buffer = parts
    buffer.put(_Write("write 1", 0.02))
    buffer.put(_Write("write 2", 0.05))
    commit = asyncio.create_task(tm.commit(OFFSETS))
    await asyncio.sleep(0.01)
    buffer.put(_Write("write 3, after the commit began", 10))  # not waited for
    assert await asyncio.wait_for(commit, 5)
    assert producer.committed_with == [["write 1", "write 2"]]


async def test_a_write_already_taken_off_the_queue_is_still_waited_for(
    parts: tuple[TransactionManager, _Producer, _Buffer],
) -> None:
    """The sender takes a record off the queue before aiokafka accepts it: an empty queue does
    not mean every write was sent (the case that lost table writes at shutdown)."""
    tm, producer, buffer = parts
    buffer.put(_Write("in flight", 0.2))
    await asyncio.sleep(0.02)
    assert buffer.size == 0 and not buffer.sent  # off the queue, not yet with Kafka
    assert await asyncio.wait_for(tm.commit(OFFSETS, start_new_transaction=False), 5)
    assert producer.committed_with == [["in flight"]]


async def test_a_failed_table_write_refuses_the_commit(
    parts: tuple[TransactionManager, _Producer, _Buffer],
) -> None:
    tm, producer, buffer = parts
    buffer.put(_Write("lost", 0.01, fails=True))
    with pytest.raises(UnsentTableWrite, match="failed"):
        await tm.commit(OFFSETS)
    assert producer.committed_with == []


class _Batch:
    def __init__(self, room: int) -> None:
        self.room = room
        self.records: list[tuple[bytes, bytes | None]] = []

    def append(self, *, key: bytes, value: bytes | None, timestamp: None) -> object | None:
        if len(self.records) >= self.room:
            return None
        self.records.append((key, value))
        return object()


class _BatchProducer:
    """aiokafka's batch API as the worker's table writes use it."""

    def __init__(self, room: int, fail: bool = False) -> None:
        self.room, self.fail = room, fail
        self.sent: list[tuple[str, int, list[tuple[bytes, bytes | None]]]] = []

    def create_batch(self) -> _Batch:
        return _Batch(self.room)

    async def send_batch(self, batch: _Batch, topic: str, *, partition: int) -> Any:
        self.sent.append((topic, partition, batch.records))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.fail:
            done.set_exception(RuntimeError("broker said no"))
        else:
            done.set_result(None)
        return done


async def test_table_records_leave_as_one_batch_per_partition_and_a_failure_refuses() -> None:
    producer = _BatchProducer(room=3)
    app = SimpleNamespace(
        in_transaction=False, producer=SimpleNamespace(_ensure_producer=lambda: producer)
    )
    records = [("load", 0, b"a", b"1"), ("load", 1, b"b", b"2"), ("load", 0, b"c", None)]
    records += [("index", 0, f"k{i}".encode(), b"v") for i in range(4)]
    await table_records_sent(await send_table_records(app, records), 5)
    assert [(t, p, len(r)) for t, p, r in producer.sent] == [
        ("load", 0, 2),
        ("load", 1, 1),
        ("index", 0, 3),  # a full batch goes, the rest follows in the next
        ("index", 0, 1),
    ]
    assert producer.sent[0][2] == [(b"a", b"1"), (b"c", None)]  # in order, deletes included
    failing = _BatchProducer(room=10, fail=True)
    app.producer = SimpleNamespace(_ensure_producer=lambda: failing)
    with pytest.raises(UnsentTableWrite, match="broker said no"):
        await table_records_sent(await send_table_records(app, records[:1]), 5)


async def test_table_records_are_sent_when_no_offset_moved() -> None:
    """A rebalance rewrote the tables while the input is idle: Faust finds no offset to commit
    and skips its commit, but the records the hook wrote still leave at once (not at some later
    commit, when their partition may be someone else's)."""
    write_tables_before_commit()
    producer = _BatchProducer(room=10)
    outbox: list[tuple[str, int, bytes, bytes | None]] = []
    app = SimpleNamespace(
        in_transaction=False,
        producer=SimpleNamespace(_ensure_producer=lambda: producer),
        table_outbox=outbox,
        before_commit=lambda: outbox.append(("load", 2, b"n1", b"hb")),
    )
    consumer = SimpleNamespace(app=app, _filter_committable_offsets=lambda tps: {})
    assert await Consumer._commit_tps(consumer, [], True) is False  # type: ignore[arg-type]
    assert producer.sent == [("load", 2, [(b"n1", b"hb")])] and outbox == []


class _TransactionalProducer:
    """One partition's transactional producer: each request takes ``step_s``."""

    def __init__(self, name: str, trace: list[str], step_s: float, fails: bool = False) -> None:
        self.name, self.trace, self.step_s, self.fails = name, trace, step_s, fails

    async def send_offsets_to_transaction(self, offsets: Any, group_id: str) -> None:
        self.trace.append(f"{self.name} offsets")
        await asyncio.sleep(self.step_s)

    async def commit_transaction(self) -> None:
        await asyncio.sleep(self.step_s)
        if self.fails:
            raise ConnectionError("coordinator gone")
        self.trace.append(f"{self.name} committed")

    async def begin_transaction(self) -> None:
        self.trace.append(f"{self.name} begun")


def _driver(producers: dict[str, _TransactionalProducer]) -> Any:
    from collections import defaultdict

    return SimpleNamespace(_transaction_producers=producers, _trn_locks=defaultdict(asyncio.Lock))


async def test_an_exactly_once_commit_ends_its_partitions_transactions_side_by_side() -> None:
    from faust.transport.drivers.aiokafka import Producer

    commit_transactions_together()
    commit_transactions_together()  # idempotent
    trace: list[str] = []
    producers = {f"w-0-{p}": _TransactionalProducer(f"p{p}", trace, 0.01) for p in range(4)}
    by_id = {tid: {TP("kvgate.kv-events", i): 10 * i} for i, tid in enumerate(producers)}
    await Producer.commit_transactions(_driver(producers), by_id, "w")  # type: ignore[arg-type]
    # every partition sent its offsets before any transaction ended: they ran together
    assert trace[:4] == ["p0 offsets", "p1 offsets", "p2 offsets", "p3 offsets"]
    assert sorted(trace[4:]) == sorted(
        [f"p{p} committed" for p in range(4)] + [f"p{p} begun" for p in range(4)]
    )


async def test_one_failed_transaction_is_raised_after_the_others_committed() -> None:
    from faust.transport.drivers.aiokafka import Producer

    commit_transactions_together()
    trace: list[str] = []
    producers = {
        "w-0-0": _TransactionalProducer("p0", trace, 0.01, fails=True),
        "w-0-1": _TransactionalProducer("p1", trace, 0.02),
    }
    by_id = {tid: {TP("kvgate.kv-events", 0): 1} for tid in producers}
    with pytest.raises(ConnectionError, match="coordinator"):
        await Producer.commit_transactions(  # type: ignore[arg-type]
            _driver(producers), by_id, "w", start_new_transaction=False
        )
    assert "p1 committed" in trace and "p0 committed" not in trace
    assert not any(t.endswith("begun") for t in trace)


async def test_commits_start_every_interval_whatever_each_one_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Faust sleeps a whole interval after each commit; here the sleep is what is left of the
    interval, and nothing when a commit took longer than one."""
    import streams.faustcommit as faustcommit

    commit_on_a_fixed_cadence()
    commit_on_a_fixed_cadence()  # idempotent
    clock = [100.0]
    monkeypatch.setattr(faustcommit, "_now", lambda: clock[0])
    took = iter([0.3, 0.05, 1.7])
    slept: list[float] = []

    class _Consumer:
        commit_interval = 1.0
        should_stop = False

        async def commit(self) -> None:
            clock[0] += next(took)

        async def sleep(self, n: float) -> None:
            slept.append(n)
            clock[0] += n
            if len(slept) == 4:
                self.should_stop = True

    handler = Consumer._commit_handler
    await handler.fun(_Consumer())  # type: ignore[attr-defined, arg-type]
    assert slept == pytest.approx([1.0, 0.7, 0.95, 0.0])
