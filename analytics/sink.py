"""The Kafka → ClickHouse sink: decisions, outcomes, node snapshots (heartbeats, one per node per
``snapshot_interval_s``) and ledger events, in batches, idempotent across restarts.

Offsets are committed only after a batch is inserted. A crash between the insert and the commit
re-delivers the batch; the rows carry their (partition, offset) identity and land in
ReplacingMergeTree tables keyed by it, so ``FINAL`` reads never see a duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

from aiokafka.errors import KafkaError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from analytics.clickhouse import ClickHouse
from analytics.rows import decision_row, ledger_row, node_row, outcome_row, snapshot_bucket
from analytics.schema import IDENTITY_COLUMNS
from analytics.settings import SinkSettings
from streams.kafka import KafkaBus, decode_or_dead_letter, make_consumer
from streams.schemas import Decision, Heartbeat, LedgerEvent, Outcome
from streams.settings import KafkaSettings
from streams.topics import DECISIONS, HEARTBEATS, LEDGER, OUTCOMES, TopicSpec

__all__ = ["Sink"]

log = logging.getLogger(__name__)


class Sink:
    def __init__(
        self,
        kafka: KafkaSettings,
        settings: SinkSettings,
        ch: ClickHouse,
        database: str,
        bus: KafkaBus,
    ) -> None:
        self.kafka = kafka
        self.settings = settings
        self.ch = ch
        self.db = database
        self.bus = bus
        self.specs: dict[str, tuple[TopicSpec, str]] = {
            DECISIONS.name(kafka.namespace): (DECISIONS, "decisions"),
            OUTCOMES.name(kafka.namespace): (OUTCOMES, "outcomes"),
            HEARTBEATS.name(kafka.namespace): (HEARTBEATS, "node_snapshots"),
            LEDGER.name(kafka.namespace): (LEDGER, "ledger_events"),
        }
        self.inserted = {table: 0 for _, table in self.specs.values()}
        self.dead_lettered = 0
        self.insert_errors = 0
        self.batches = 0
        self.last_lag = -1  # refreshed by refresh_lag (for /metrics)
        self._consumer: Any = None
        self._snapshot_at: dict[str, int] = {}  # node -> bucket of its last snapshot row
        self._uncommitted = 0

    async def run(self, stop: asyncio.Event | None = None) -> None:
        consumer = make_consumer(
            self.kafka,
            *self.specs,
            group_id=self.settings.group_id,
            client_id="kvgate-sink",
            isolation_level="read_committed",
        )
        self._consumer = consumer
        await consumer.start()
        rows: dict[str, list[dict[str, Any]]] = {table: [] for _, table in self.specs.values()}
        first_at: float | None = None
        try:
            while stop is None or not stop.is_set():
                batches = await consumer.getmany(
                    timeout_ms=100, max_records=self.settings.batch_rows
                )
                for tp, records in batches.items():
                    for r in records:
                        await self._convert(r, tp.topic, rows)
                n = sum(len(batch) for batch in rows.values())
                if n and first_at is None:
                    first_at = time.monotonic()
                due = first_at is not None and (
                    n >= self.settings.batch_rows
                    or time.monotonic() - first_at >= self.settings.batch_interval_s
                )
                if due or (batches and n == 0):
                    await self._flush(consumer, rows)
                    first_at = None
            await self._flush(consumer, rows, final=True)
        finally:
            self._consumer = None
            await consumer.stop()

    async def _convert(self, r: Any, topic: str, rows: dict[str, list[dict[str, Any]]]) -> None:
        spec, table = self.specs[topic]
        if r.value is None and spec is HEARTBEATS:  # a retired node's tombstone
            return
        msg = await decode_or_dead_letter(self.bus, spec, r, "sink")
        if isinstance(msg, Decision):
            row = decision_row(msg, r.partition, r.offset)
            if self.settings.identity_retention_days == 0:  # never stored
                for column in IDENTITY_COLUMNS["decisions"]:
                    row[column] = None
            rows[table].append(row)
        elif isinstance(msg, Outcome):
            rows[table].append(outcome_row(msg, r.partition, r.offset))
        elif isinstance(msg, LedgerEvent):
            rows[table].append(ledger_row(msg, r.partition, r.offset))
        elif isinstance(msg, Heartbeat):
            interval = self.settings.snapshot_interval_s
            bucket = snapshot_bucket(msg.ts, interval)
            if self._snapshot_at.get(msg.node_id) != bucket:  # the node's first in this bucket
                self._snapshot_at[msg.node_id] = bucket
                rows[table].append(node_row(msg, interval, r.partition, r.offset))
        else:
            self.dead_lettered += 1

    async def _flush(
        self, consumer: Any, rows: dict[str, list[dict[str, Any]]], final: bool = False
    ) -> None:
        for table, batch in rows.items():
            if batch:
                try:
                    self.ch.insert_json(f"{self.db}.{table}", batch)
                except Exception:
                    self.insert_errors += 1
                    raise
                self.inserted[table] += len(batch)
                self.batches += 1
                batch.clear()
        await self.bus.flush()  # dead letters are durable before their offsets are committed
        self._uncommitted += 1
        if self._uncommitted < self.settings.commit_every and not final:
            return
        try:
            await consumer.commit()
            self._uncommitted = 0
        except KafkaError as exc:
            log.warning("offset commit failed (rows will be re-inserted idempotently): %s", exc)

    async def lag(self) -> int:
        """Messages on its topics not yet committed by this sink (0 when drained)."""
        consumer = self._consumer
        if consumer is None:
            return -1
        tps = [tp for tp in consumer.assignment()]
        if not tps:
            return -1
        ends = await consumer.end_offsets(tps)
        total = 0
        for tp in tps:
            committed = await consumer.committed(tp)
            total += max(0, ends[tp] - (committed or 0))
        return total

    async def refresh_lag(self) -> None:
        try:
            self.last_lag = await self.lag()
        except KafkaError:
            self.last_lag = -1


class SinkCollector:
    """The sink's figures for Prometheus, read at scrape time."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def collect(self) -> Iterator[Metric]:
        s = self.sink
        rows = CounterMetricFamily(
            "kvgate_sink_rows_inserted", "Rows inserted into ClickHouse", labels=["table"]
        )
        for table, n in sorted(s.inserted.items()):
            rows.add_metric([table], n)
        yield rows
        yield CounterMetricFamily("kvgate_sink_batches", "Batches inserted", value=s.batches)
        yield CounterMetricFamily(
            "kvgate_sink_insert_errors", "Inserts ClickHouse refused", value=s.insert_errors
        )
        yield CounterMetricFamily(
            "kvgate_sink_dead_lettered",
            "Messages sent to the dead-letter topic",
            value=s.dead_lettered,
        )
        yield GaugeMetricFamily(
            "kvgate_sink_consumer_lag",
            "Messages on its topics not yet committed (-1: not assigned yet)",
            value=s.last_lag,
        )
