"""The bus's batched hand-over against the real broker: a keyed record lands on the partition
aiokafka's own per-message path puts the same key on (Kafka's default partitioner), and the
records of one key keep their order."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from streams.kafka import KafkaBus, ensure_topics, make_consumer
from streams.settings import KafkaSettings
from streams.topics import OUTCOMES
from tests.factories import outcome

pytestmark = pytest.mark.integration


async def test_batched_records_land_where_the_default_partitioner_puts_their_keys(
    kafka_settings: KafkaSettings,
) -> None:
    await ensure_topics(kafka_settings)
    topic = OUTCOMES.name(kafka_settings.namespace)
    keys = [f"req-{i:04x}" for i in range(64)]
    bus = KafkaBus(kafka_settings, "t-bus")
    await bus.start()
    try:
        for k in keys:
            await bus.send(OUTCOMES, k, outcome(f"{k}/send"))  # aiokafka's per-message path
        for n in range(3):
            for k in keys:
                await bus.publish(OUTCOMES, k, outcome(f"{k}/{n}"))  # batched
        await asyncio.wait_for(bus.flush(), 30)
        assert bus.queued == 0 and bus.delivered == 3 * len(keys)
    finally:
        await bus.stop()
    consumer = make_consumer(kafka_settings, topic, group_id=None, client_id="t-bus-read")
    await consumer.start()
    seen: dict[str, list[tuple[int, str]]] = defaultdict(list)
    try:
        while sum(map(len, seen.values())) < 4 * len(keys):
            got = await asyncio.wait_for(consumer.getmany(timeout_ms=500), 30)
            for tp, records in got.items():
                for r in records:
                    assert r.key is not None
                    rid = r.value.decode().split('"request_id":"', 1)[1].split('"', 1)[0]
                    seen[r.key.decode()].append((tp.partition, rid))
    finally:
        await consumer.stop()
    partitions_used = set()
    for k in keys:
        (partition,) = {p for p, _ in seen[k]}  # the batched records joined the sent one
        partitions_used.add(partition)
        assert [rid for _, rid in seen[k]] == [f"{k}/send", f"{k}/0", f"{k}/1", f"{k}/2"]
    assert len(partitions_used) > 1  # the keys did spread: the check above compared something
