"""kvgate autoscale on real Kafka: heartbeats and decisions in, scale messages out, malformed
input dead-lettered."""

from __future__ import annotations

import asyncio
import time

import pytest

from analytics.autoscale import AutoscaleSettings
from analytics.autoscaler import AutoscaleService
from streams.kafka import KafkaBus, ensure_topics
from streams.schemas import ControlMessage, DeadLetter
from streams.settings import KafkaSettings
from streams.topics import CONTROL, DECISIONS, DLQ, HEARTBEATS
from tests.factories import decision, heartbeat
from tests.integration.cluster import read_topic

pytestmark = pytest.mark.integration


async def test_desired_replicas_follow_the_traffic(kafka_settings: KafkaSettings) -> None:
    await ensure_topics(kafka_settings)
    bus = KafkaBus(kafka_settings, "t-autoscale")
    await bus.start()
    settings = AutoscaleSettings(replica_rps=2.0, interval_s=2.0, target_utilization=1.0)
    service = AutoscaleService(kafka_settings, settings, bus)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    ns = kafka_settings.namespace
    try:
        await asyncio.sleep(2.0)  # the service reads from the latest offsets
        await bus.publish_raw(HEARTBEATS.name(ns), b"n-bad", b"{not json")
        for rnd in range(6):  # 20 requests per 2 s for a 1-replica pool: 10 req/s
            now = time.time()
            await bus.send(HEARTBEATS, "n1", heartbeat("n1", seq=rnd, ts=now, running=4))
            for i in range(20):
                await bus.send(DECISIONS, f"r{rnd}-{i}", decision(f"r{rnd}-{i}", ts=now))
            await asyncio.sleep(1.0)

        def enough(got: list[ControlMessage]) -> bool:
            return any(m.kind == "scale" and m.payload["arrivals_rps"] >= 15 for m in got)

        got = await read_topic(kafka_settings, CONTROL, ControlMessage, enough, 30)
        scale = [m for m in got if m.kind == "scale"]
        assert all(m.subject == "scale/default/m" for m in scale)
        busy = [m for m in scale if m.payload["arrivals_rps"] >= 15]
        assert busy and max(m.payload["desired_replicas"] for m in busy) >= 5  # 10 req/s ÷ 2
        assert busy[-1].payload["serving_replicas"] == 1
        letters = await read_topic(kafka_settings, DLQ, DeadLetter, lambda g: len(g) >= 1, 30)
        assert letters[0].consumer == "autoscale" and letters[0].value == "{not json"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await bus.stop()
