"""The Kafka bus's outbox: publishing never waits on the broker, a full outbox drops and counts,
and what the broker refused is retried in order until it is taken."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError, RecordTooLargeError

from streams.kafka import KafkaBus
from streams.schemas import DeadLetter
from streams.settings import KafkaSettings
from streams.topics import DLQ


def _letter(i: int) -> DeadLetter:
    return DeadLetter(
        source_topic="t",
        partition=0,
        offset=i,
        key=None,
        value="x",
        error="e",
        consumer="c",
        ts=1.0,
    )


class Batch:
    """aiokafka's batch builder, as far as the bus uses it: at most ``room`` messages."""

    def __init__(self, room: int) -> None:
        self.room, self.values = room, []  # type: list[bytes]

    def append(self, *, key: bytes | None, value: bytes, timestamp: None) -> object | None:
        if len(self.values) >= self.room:
            return None
        self.values.append(value)
        return object()


class FlakyProducer:
    """Stands in for aiokafka's producer: refuses the first ``refuse`` batches (as aiokafka does
    when the broker is away), fails the delivery of the next ``fail`` ones, then takes all."""

    def __init__(self, refuse: int, fail: int, room: int = 8) -> None:
        self.refuse, self.fail, self.room = refuse, fail, room
        self.taken: list[bytes] = []
        self.batches = 0

    async def partitions_for(self, topic: str) -> set[int]:
        return {0}

    def create_batch(self) -> Batch:
        return Batch(self.room)

    async def send_batch(self, batch: Batch, topic: str, *, partition: int) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.refuse:
            self.refuse -= 1
            raise KafkaTimeoutError("no broker")
        if self.fail:
            self.fail -= 1
            fut.set_exception(KafkaTimeoutError("delivery timed out"))
            return fut
        if len(batch.values) > 1 and b"big" in batch.values:
            fut.set_exception(RecordTooLargeError("the batch is over the broker's limit"))
            return fut
        self.batches += 1
        self.taken.extend(batch.values)
        fut.set_result(None)
        return fut

    async def send(self, topic: str, value: bytes, key: bytes | None) -> asyncio.Future[Any]:
        if value == b"big":
            raise MessageSizeTooLargeError("over max_request_size")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.taken.append(value)
        fut.set_result(None)
        return fut

    async def flush(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def test_publish_never_suspends() -> None:
    """``publish`` completes without yielding to the loop once: nothing on the request path
    waits for Kafka, whatever state the broker is in (this bus was never even started)."""
    bus = KafkaBus(KafkaSettings(bootstrap_servers="127.0.0.1:1"), "t")
    for i in range(1000):
        coro = bus.publish(DLQ, "k", _letter(i))
        with pytest.raises(StopIteration):
            coro.send(None)
    assert bus.queued == 1000 and not bus.dropped


def test_a_full_outbox_drops_and_counts() -> None:
    bus = KafkaBus(KafkaSettings(outbox_max_messages=10), "t")
    kept = [bus.enqueue("a", None, b"v") for _ in range(15)]
    assert kept.count(True) == 10 and bus.dropped == {"a": 5}
    small = KafkaBus(KafkaSettings(outbox_max_bytes=1 << 16), "t")
    assert small.enqueue("b", None, b"x" * 60_000)
    assert not small.enqueue("b", None, b"x" * 10_000)
    assert small.dropped == {"b": 1}


@pytest.mark.parametrize("refuse, fail", [(3, 0), (0, 2), (3, 2)])
async def test_refused_and_failed_messages_are_retried(refuse: int, fail: int) -> None:
    """Batches the producer refuses keep their place (the order is exact); batches whose
    delivery fails go back to the front of the outbox. Nothing is lost, nothing is sent
    twice."""
    bus = KafkaBus(KafkaSettings(), "t")
    producer = FlakyProducer(refuse, fail)
    bus._producer_obj = producer  # type: ignore[assignment]
    bus._drainer = asyncio.create_task(bus._drain())
    values = [f"m{i:02d}".encode() for i in range(50)]
    for v in values:
        bus.enqueue("t", None, v)
    await asyncio.wait_for(bus.flush(), 10)
    assert sorted(producer.taken) == values
    if not fail:
        assert producer.taken == values
    assert bus.send_errors == refuse + fail and bus.retried >= refuse + fail
    assert bus.queued == 0 and bus.delivered == 50
    assert producer.batches == 7  # 50 messages, 8 to a batch
    await bus.stop()


async def test_messages_queued_while_a_pass_waits_are_counted_until_delivered() -> None:
    """``queued`` counts what a hand-over holds, so ``flush`` waits for it."""
    bus = KafkaBus(KafkaSettings(), "t")
    producer = FlakyProducer(0, 0, room=2)
    gate = asyncio.Event()
    send_batch = producer.send_batch

    async def slow(batch: Batch, topic: str, *, partition: int) -> asyncio.Future[Any]:
        await gate.wait()
        return await send_batch(batch, topic, partition=partition)

    producer.send_batch = slow  # type: ignore[method-assign]
    bus._producer_obj = producer  # type: ignore[assignment]
    bus._drainer = asyncio.create_task(bus._drain())
    for i in range(5):
        bus.enqueue("t", None, b"%d" % i)
    await asyncio.sleep(0.05)
    assert not bus._outbox and bus.queued == 5  # all taken, none delivered
    gate.set()
    await asyncio.wait_for(bus.flush(), 10)
    assert producer.taken == [b"0", b"1", b"2", b"3", b"4"] and bus.queued == 0
    await bus.stop()


async def test_a_batch_refused_whole_is_sent_again_one_by_one_and_its_culprit_dropped() -> None:
    bus = KafkaBus(KafkaSettings(), "t")
    producer = FlakyProducer(0, 0)
    bus._producer_obj = producer  # type: ignore[assignment]
    bus._drainer = asyncio.create_task(bus._drain())
    values = [b"a", b"b", b"big", b"c"]
    for v in values:
        bus.enqueue("t", None, v)
    await asyncio.wait_for(bus.flush(), 10)
    assert producer.taken == [b"a", b"b", b"c"] and bus.refused == {"t": 1}
    assert bus.queued == 0 and bus.delivered == 3 and not bus._alone
    await bus.stop()
