"""The Kafka bus's outbox: publishing never waits on the broker, a full outbox drops and counts,
and what the broker refused is retried in order until it is taken."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError

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


class FlakyProducer:
    """Stands in for aiokafka's producer: refuses the first ``refuse`` sends (as aiokafka does
    when the broker is away), fails the delivery of the next ``fail`` ones, then takes all."""

    def __init__(self, refuse: int, fail: int) -> None:
        self.refuse, self.fail = refuse, fail
        self.taken: list[bytes] = []

    async def send(self, topic: str, value: bytes, key: bytes | None) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.refuse:
            self.refuse -= 1
            raise KafkaTimeoutError("no broker")
        if self.fail:
            self.fail -= 1
            fut.set_exception(KafkaTimeoutError("delivery timed out"))
            return fut
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
    """Sends the producer refuses keep their place (the order is exact); deliveries that
    fail go back to the front of the outbox. Nothing is lost, nothing is sent twice."""
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
    assert bus.retried == refuse + fail and bus.send_errors == refuse + fail
    assert bus.queued == 0 and bus.delivered == 50
    await bus.stop()
