"""Malformed messages go to the dead-letter topic and processing continues; bad HTTP gets a 4xx."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from analytics.clickhouse import open_clickhouse
from analytics.schema import migrate
from analytics.settings import ClickHouseSettings, SinkSettings
from analytics.sink import Sink
from deploy.procs import Supervisor
from streams.kafka import KafkaBus, ensure_topics
from streams.replica import TableReplica
from streams.schemas import DeadLetter, Outcome
from streams.settings import KafkaSettings, WorkerSettings
from streams.topics import DECISIONS, DLQ, HEARTBEATS, KV_EVENTS, OUTCOMES
from tests.conftest import wait_until
from tests.factories import heartbeat
from tests.integration.cluster import MODEL, Cluster, read_topic

pytestmark = pytest.mark.integration


async def read_dlq(kafka: KafkaSettings, want: int, timeout_s: float = 30) -> list[DeadLetter]:
    return await read_topic(kafka, DLQ, DeadLetter, lambda got: len(got) >= want, timeout_s)


async def test_malformed_input_messages_are_dead_lettered_and_worker_continues(
    supervisor: Supervisor,
    kafka_settings: KafkaSettings,
    worker_settings: WorkerSettings,
) -> None:
    await ensure_topics(kafka_settings)
    Cluster(supervisor).add_worker()
    bus = KafkaBus(kafka_settings, "t-bad")
    await bus.start()
    replica = TableReplica(kafka_settings, worker_settings, "t-replica")
    try:
        ns = kafka_settings.namespace
        await bus.publish_raw(HEARTBEATS.name(ns), b"n-bad", b"{not json")
        await bus.publish_raw(KV_EVENTS.name(ns), b"n-bad", orjson.dumps({"schema_version": 9}))
        await bus.send(HEARTBEATS, "n-good", heartbeat("n-good", 0))
        await bus.flush()
        letters = await read_dlq(kafka_settings, 2, timeout_s=60)
        assert sorted(x.source_topic for x in letters) == sorted(
            [HEARTBEATS.name(ns), KV_EVENTS.name(ns)]
        )
        assert all(x.error and x.consumer.startswith("worker.") for x in letters)
        assert any(x.value == "{not json" for x in letters)  # the original bytes are kept
        await replica.start()
        await wait_until(lambda: _has(replica, "n-good"), 30, "the valid heartbeat in the table")
        assert "n-bad" not in replica.load
    finally:
        await replica.stop()
        await bus.stop()


async def _has(replica: TableReplica, node: str) -> bool:
    return node in replica.load


async def test_malformed_analytics_messages_are_dead_lettered_by_the_sink(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    await ensure_topics(kafka_settings)
    ch = open_clickhouse(ClickHouseSettings(path=str(tmp_path / "ch")))
    migrate(ch, "kvgate")
    bus = KafkaBus(kafka_settings, "t-sink")
    await bus.start()
    stop = asyncio.Event()
    sink = Sink(kafka_settings, SinkSettings(group_id="s", batch_interval_s=0.2), ch, "kvgate", bus)
    task = asyncio.create_task(sink.run(stop))
    try:
        ns = kafka_settings.namespace
        await bus.publish_raw(DECISIONS.name(ns), b"r1", b"\xff\xfe garbage")
        good = Outcome(
            request_id="r2",
            ts=time.time(),
            router_id="t",
            node_id="n",
            status="ok",
            http_status=200,
            e2e_s=0.1,
            prompt_tokens=1,
            output_tokens=1,
        )
        await bus.publish(OUTCOMES, "r2", good)
        await bus.flush()
        letters = await read_dlq(kafka_settings, 1)
        assert [x.source_topic for x in letters] == [DECISIONS.name(ns)]
        assert letters[0].consumer == "sink"

        async def landed() -> bool:
            return int(ch.query("SELECT count() AS n FROM kvgate.outcomes")[0]["n"]) == 1

        await wait_until(landed, 20, "the valid outcome row")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await bus.stop()
        ch.close()


async def test_malformed_http_requests_get_a_4xx_json_error(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    c, router = await Cluster.started(supervisor, {"n1": {}})
    engine = c.engines["n1"]
    cases = [
        ("/v1/completions", b"{broken", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", orjson.dumps({"model": MODEL}), 400),
        ("/v1/completions", orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}), 400),
        (
            "/v1/completions",
            orjson.dumps({"model": MODEL, "prompt": "x", "n": 3, "best_of": 2}),
            400,
        ),
        ("/v1/chat/completions", orjson.dumps({"model": MODEL, "messages": []}), 400),
        # any role is taken (as vLLM takes custom roles), but not an empty or a huge one
        ("/v1/chat/completions", orjson.dumps({"model": MODEL, "messages": [{"role": ""}]}), 400),
        (
            "/v1/chat/completions",
            orjson.dumps({"model": MODEL, "messages": [{"role": "r" * 65, "content": "hi"}]}),
            400,
        ),
        ("/v1/completions", orjson.dumps({"model": "nope", "prompt": "x"}), 404),
    ]
    async with aiohttp.ClientSession() as http:
        for base in (router, engine):
            for path, body, status in cases:
                if base == engine and body == b"[1, 2]":
                    status = 400
                async with http.post(
                    base + path, data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    assert r.status == status, (base, path, body, await r.text())
                    err = await r.json(content_type=None)
                    assert err["error"]["message"], err
