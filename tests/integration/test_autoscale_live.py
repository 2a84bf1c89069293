"""kvgate autoscale on real Kafka: heartbeats and decisions in, scale messages out, malformed
input dead-lettered."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from analytics.autoscale import AutoscaleSettings
from analytics.autoscaler import AutoscaleService
from analytics.clickhouse import open_clickhouse
from analytics.rows import decision_row
from analytics.schema import migrate
from analytics.settings import ClickHouseSettings
from deploy.procs import Supervisor
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


async def test_a_restarted_autoscaler_starts_from_the_recorded_arrivals(
    supervisor: Supervisor, kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    """``kvgate autoscale`` started over a decision log (the embedded ClickHouse the sink wrote,
    the sink stopped): the pool is decided from the first interval, on its recorded rate, though
    nothing of it is live — a cold start would not know the pool at all."""
    await ensure_topics(kafka_settings)
    now = time.time()
    ch = open_clickhouse(ClickHouseSettings(path=str(tmp_path / "clickhouse")))
    try:
        migrate(ch, "kvgate")
        rows = []
        # 3 requests/s over the last ten minutes and the next half minute (the service starts
        # in between: it reads up to its last whole interval, not what is dated later)
        for second in range(-30, 600):
            for k in range(3):
                d = decision(f"r{second}-{k}", ts=now - second, pool="batch", model="m")
                rows.append(decision_row(d, 0, len(rows)))
        ch.insert_json("kvgate.decisions", rows)
    finally:
        ch.close()
    supervisor.spawn(
        "autoscale",
        "autoscale",
        env={
            "KVGATE_AUTOSCALE__INTERVAL_S": "2",
            "KVGATE_AUTOSCALE__REPLICA_RPS": "1",
            "KVGATE_AUTOSCALE__TARGET_UTILIZATION": "1",
            "KVGATE_AUTOSCALE__METRICS_PORT": "0",
        },
    )

    def decided(got: list[ControlMessage]) -> bool:
        return any(m.subject == "scale/batch/m" for m in got)

    got = await read_topic(kafka_settings, CONTROL, ControlMessage, decided, 60)
    first = next(m for m in got if m.subject == "scale/batch/m")
    assert first.payload["serving_replicas"] == 0 and first.payload["arrivals_rps"] == 0
    # sized on the recorded 3 req/s (the last intervals' mean with this quiet one), 1 req/s each
    assert first.payload["desired_replicas"] >= 2
    log = supervisor.procs["autoscale"].log.read_text()
    assert "arrival history of 1 pool/model(s)" in log
