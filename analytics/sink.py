"""The Kafka → ClickHouse sink: decisions and outcomes, in batches, idempotent across restarts.

Offsets are committed only after a batch is inserted. A crash between the insert and the commit
re-delivers the batch; the rows carry their (partition, offset) identity and land in
ReplacingMergeTree tables keyed by it, so ``FINAL`` reads never see a duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiokafka.errors import KafkaError

from analytics.clickhouse import ClickHouse
from analytics.rows import decision_row, outcome_row
from analytics.settings import SinkSettings
from streams.kafka import KafkaBus, decode_or_dead_letter, make_consumer
from streams.schemas import Decision, Outcome
from streams.settings import KafkaSettings
from streams.topics import DECISIONS, OUTCOMES

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
        self.decisions_topic = DECISIONS.name(kafka.namespace)
        self.outcomes_topic = OUTCOMES.name(kafka.namespace)
        self.inserted = {"decisions": 0, "outcomes": 0}
        self.dead_lettered = 0
        self._consumer: Any = None

    async def run(self, stop: asyncio.Event | None = None) -> None:
        consumer = make_consumer(
            self.kafka,
            self.decisions_topic,
            self.outcomes_topic,
            group_id=self.settings.group_id,
            client_id="kvgate-sink",
            isolation_level="read_committed",
        )
        self._consumer = consumer
        await consumer.start()
        rows: dict[str, list[dict[str, Any]]] = {"decisions": [], "outcomes": []}
        first_at: float | None = None
        try:
            while stop is None or not stop.is_set():
                batches = await consumer.getmany(
                    timeout_ms=100, max_records=self.settings.batch_rows
                )
                for tp, records in batches.items():
                    for r in records:
                        await self._convert(r, tp.topic, rows)
                n = len(rows["decisions"]) + len(rows["outcomes"])
                if n and first_at is None:
                    first_at = time.monotonic()
                due = first_at is not None and (
                    n >= self.settings.batch_rows
                    or time.monotonic() - first_at >= self.settings.batch_interval_s
                )
                if due or (batches and n == 0):
                    await self._flush(consumer, rows)
                    first_at = None
            await self._flush(consumer, rows)
        finally:
            self._consumer = None
            await consumer.stop()

    async def _convert(self, r: Any, topic: str, rows: dict[str, list[dict[str, Any]]]) -> None:
        spec = DECISIONS if topic == self.decisions_topic else OUTCOMES
        msg = await decode_or_dead_letter(self.bus, spec, r, "sink")
        if isinstance(msg, Decision):
            rows["decisions"].append(decision_row(msg, r.partition, r.offset))
        elif isinstance(msg, Outcome):
            rows["outcomes"].append(outcome_row(msg, r.partition, r.offset))
        else:
            self.dead_lettered += 1

    async def _flush(self, consumer: Any, rows: dict[str, list[dict[str, Any]]]) -> None:
        for table, batch in rows.items():
            if batch:
                self.ch.insert_json(f"{self.db}.{table}", batch)
                self.inserted[table] += len(batch)
                batch.clear()
        await self.bus.flush()  # dead letters are durable before their offsets are committed
        try:
            await consumer.commit()
        except KafkaError as exc:
            log.warning("offset commit failed (rows will be re-inserted idempotently): %s", exc)

    async def lag(self) -> int:
        """Messages on the two topics not yet committed by this sink (0 when drained)."""
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
