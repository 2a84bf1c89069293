"""Kill -9 the sink mid-batch: after a restart, ClickHouse holds every decision, outcome and
ledger event exactly once (the re-delivered batches were inserted again and collapsed)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from deploy.procs import Supervisor
from streams.kafka import KafkaBus, ensure_topics
from streams.settings import KafkaSettings
from streams.topics import DECISIONS, LEDGER, OUTCOMES
from tests.chfront import ChdbFront, sink_env
from tests.conftest import wait_until
from tests.factories import decision, ledger_event, outcome

pytestmark = [pytest.mark.integration, pytest.mark.fault]

N = 3000


async def test_sink_killed_mid_batch_loses_and_duplicates_nothing(
    supervisor: Supervisor, kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    await ensure_topics(kafka_settings)
    bus = KafkaBus(kafka_settings, "t-sink-producer")
    await bus.start()
    try:
        for i in range(N):
            rid = f"r{i:05d}"
            await bus.publish(DECISIONS, rid, decision(rid))
            await bus.publish(OUTCOMES, rid, outcome(rid))
            await bus.publish(LEDGER, "default", ledger_event(rid, "reserve"))
        await bus.flush()
    finally:
        await bus.stop()

    with ChdbFront(str(tmp_path / "ch")) as front:

        def count(sql: str) -> int:
            return int(front._run(sql, "CSV") or b"0")

        supervisor.env.update(
            sink_env(
                front,
                kafka_settings.namespace,
                KVGATE_SINK__BATCH_ROWS="500",
                KVGATE_SINK__BATCH_INTERVAL_S="0.2",
                # offsets only every 1000 batches: whatever the first sink inserted before the
                # kill is delivered again to the second
                KVGATE_SINK__COMMIT_EVERY="1000",
            )
        )
        supervisor.spawn("sink", "sink")

        async def some_inserted() -> bool:
            return front.inserted_rows.get("kvgate.decisions", 0) >= 1000

        await wait_until(some_inserted, 60, "the first sink to insert batches", 0.02)
        supervisor.kill("sink", signal.SIGKILL)
        # a batch the sink had sent before it died is still inserted (and counted): wait until
        # the front has been quiet for a while before taking the first run's count
        await asyncio.sleep(0.5)

        async def quiet() -> bool:
            return front.active == 0

        await wait_until(quiet, 10, "the front to finish its requests")
        first_run = dict(front.inserted_rows)
        assert first_run.get("kvgate.decisions", 0) < N or first_run.get("kvgate.outcomes", 0) < N

        supervisor.spawn("sink", "sink")

        async def all_landed() -> bool:
            return all(
                count(f"SELECT count() FROM kvgate.{t} FINAL") >= N
                for t in ("decisions", "outcomes", "ledger_events")
            )

        await wait_until(all_landed, 90, "every row in ClickHouse", 0.25)
        await asyncio.sleep(1.0)  # a duplicate would have landed by now
        supervisor.kill("sink", signal.SIGTERM)
        for table in ("decisions", "outcomes"):
            assert count(f"SELECT count() FROM kvgate.{table} FINAL") == N, table
            assert count(f"SELECT uniqExact(request_id) FROM kvgate.{table} FINAL") == N, table
            # nothing was committed before the kill: the second sink inserted everything again
            key = f"kvgate.{table}"
            assert front.inserted_rows[key] == first_run.get(key, 0) + N, table
        assert first_run["kvgate.decisions"] >= 1000  # the kill came after real inserts
        assert count("SELECT count() FROM kvgate.ledger_events FINAL") == N
        assert count("SELECT uniqExact(reservation_id) FROM kvgate.ledger_events FINAL") == N
