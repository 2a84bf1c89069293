"""The bus's batched hand-over against the real broker: a keyed record lands on the partition
aiokafka's own per-message path puts the same key on (Kafka's default partitioner), the records
of one key keep their order, and nothing published is lost when the broker is killed and comes
back."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.procs import DEPLOY, LocalInfra, free_port
from streams.kafka import KafkaBus, ensure_topics, make_consumer
from streams.schemas import Outcome
from streams.settings import KafkaSettings
from streams.topics import OUTCOMES
from tests.factories import outcome
from tests.integration.cluster import read_topic

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


@pytest.fixture
def own_broker(kafka_up: str) -> Iterator[LocalInfra]:
    """A broker of this test's own (the repo's launcher, a fresh data folder), to kill -9."""
    port = free_port(span=2)  # (its controller listens on port + 1)
    infra = LocalInfra(kafka_port=port, redis_port=0)
    infra.up("kafka")
    try:
        yield infra
    finally:
        infra.down()
        infra.run("kafka", "wipe")  # its data, log and configuration


def _kafka_home() -> Path:
    return Path(os.environ.get("KVGATE_LOCAL", DEPLOY.parent / ".local")) / "kafka"


async def test_the_outbox_delivers_everything_through_a_broker_killed_and_restarted(
    own_broker: LocalInfra,
) -> None:
    """Records published before, during and after a ``kill -9`` of the broker all arrive once
    it is back (at least once: a batch the broker took without answering may arrive twice, and
    its readers key rows by message identity); ``publish`` never waited meanwhile."""
    settings = KafkaSettings(
        bootstrap_servers=f"127.0.0.1:{own_broker.kafka_port}",
        namespace=f"t{uuid.uuid4().hex[:10]}",
        partitions=2,
    )
    await ensure_topics(settings, [OUTCOMES])
    bus = KafkaBus(settings, "t-bus-outage", linger_ms=5)
    await bus.start()
    # the producer gives up on a hand-over after 2 s instead of 40: the outage outlasts it, so
    # what was taken from the outbox goes back to it and is handed over again
    bus._producer._request_timeout_ms = 2000
    bus._producer.client._request_timeout_ms = 2000
    sent: list[str] = []

    async def publish(phase: str, n: int) -> None:
        for i in range(n):
            rid = f"{phase}-{i:03d}"
            coro = bus.publish(OUTCOMES, f"k{i % 8}", outcome(rid))
            with pytest.raises(StopIteration):  # done without suspending: never waits on Kafka
                coro.send(None)
            sent.append(rid)
            await asyncio.sleep(0.005)

    try:
        await publish("before", 100)
        await asyncio.wait_for(bus.flush(), 30)
        pid = int((_kafka_home() / f"kafka-{own_broker.kafka_port}.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        await publish("during", 200)
        assert bus.queued > 0  # held in the outbox while the broker is away
        for _ in range(300):  # gone (reaped), so that the launcher does not find it running
            if not Path(f"/proc/{pid}").exists():
                break
            await asyncio.sleep(0.1)
        res = await asyncio.to_thread(own_broker.run, "kafka", "start")
        assert res.returncode == 0, res.stdout + res.stderr
        await publish("after", 100)
        await asyncio.wait_for(bus.flush(), 120)
        assert bus.queued == 0 and not bus.dropped and not bus.refused
        assert bus.send_errors > 0 and bus.retried > 0  # the outage was outlasted
    finally:
        await bus.stop()
    got = await read_topic(settings, OUTCOMES, Outcome, lambda xs: len(xs) >= len(sent), 60)
    ids = [o.request_id for o in got]
    assert set(ids) == set(sent)  # nothing lost
    assert len(ids) - len(set(ids)) <= 50  # at most a redelivered batch's worth twice
