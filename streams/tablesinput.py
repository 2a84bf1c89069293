"""Replicas of a worker's tables: bootstrap from the tables, then follow the input:

1. read the committed offsets of the worker's consumer group on the input topics;
2. read the table changelogs (``load``, ``prefix_segments``) to their end,
   ``read_committed`` — under exactly-once that is the state the worker committed *at least up to*
   those offsets — keeping the last record per key (what compaction keeps), then fold those: a
   changelog not yet compacted holds a minute or more of rewrites that need not be folded;
3. consume the input topics (heartbeats, KV events) from those offsets and fold every event with
   the worker's own pure folds (:mod:`streams.folds`); the per-node cursors skip what the tables
   already held, so the result is exact, and every later event reaches the router without waiting
   for the worker's transaction to commit.

A router killed at any time rebuilds the same state on restart. ``follow_input=False`` keeps
following the changelogs instead: the replica then shows exactly what the tables hold (tests and
operators use it to check the worker).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from streams.background import Background
from streams.kafka import make_consumer
from streams.settings import KafkaSettings, WorkerSettings
from streams.tables import app_id

__all__ = ["TablesThenInput"]

log = logging.getLogger(__name__)


class TablesThenInput(Background):
    """Bootstrap from a worker's table changelogs, then follow its input topics (the three
    phases in this module's docstring). Subclasses name the topics and fold the records."""

    def __init__(
        self,
        kafka: KafkaSettings,
        worker: WorkerSettings,
        client_id: str,
        changelogs: tuple[str, ...],
        inputs: tuple[str, ...],
        *,
        follow_input: bool = True,
    ) -> None:
        self.kafka = kafka
        self.group = app_id(kafka, worker)
        self.changelog_topics = changelogs
        self.input_topics = inputs
        self.client_id = client_id
        self.follow_input = follow_input
        self.caught_up = asyncio.Event()
        self.records = 0
        self.bad_records = 0  # records no fold could read (keys or values): skipped, counted

    # --- to override -----------------------------------------------------------------------
    def _reset(self) -> None:
        """Forget everything (a rebuild follows)."""

    def _apply_changelog(
        self, topic: str, key: bytes | None, value: bytes | None, now: float
    ) -> None:
        raise NotImplementedError

    def _apply_input(self, topic: str, key: bytes | None, value: bytes | None, now: float) -> None:
        raise NotImplementedError

    def _bootstrap_apply(self) -> Callable[[str, bytes | None, bytes | None, float], None]:
        """What folds a changelog record while bootstrapping (phase 1 of a replica that
        follows the input); :meth:`_bootstrap_done` is called once the tables are read."""
        return self._apply_changelog

    def _bootstrap_done(self, now: float) -> None:
        """The tables were read to their end (phase 1 is over)."""

    def _tick(self, now: float) -> None:
        """Called every few seconds while following the input."""

    def _describe(self) -> str:
        return f"{self.records} records"

    # --- I/O -----------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
            except KafkaError as exc:
                self.failing = f"lost Kafka: {exc}"[:300]
                log.warning("%s lost Kafka (%s); rebuilding", self.client_id, exc)
                await asyncio.sleep(1.0)

    async def _partitions(self, consumer: Any, topic: str) -> list[TopicPartition]:
        for _ in range(600):
            parts = consumer.partitions_for_topic(topic)
            if parts:
                return [TopicPartition(topic, p) for p in sorted(parts)]
            await consumer._client.force_metadata_update()
            await asyncio.sleep(0.1)
        raise KafkaError(f"topic {topic} does not exist (is the worker running?)")

    async def _committed(self) -> dict[TopicPartition, int]:
        admin = AIOKafkaAdminClient(**self.kafka.client_options())
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(self.group)
        finally:
            await admin.close()
        return {
            tp: meta.offset
            for tp, meta in offsets.items()
            if tp.topic in self.input_topics and meta.offset >= 0
        }

    async def _follow(self) -> None:
        self._reset()
        committed = await self._committed() if self.follow_input else {}
        # phase 1: the tables, as committed by the worker
        tables = make_consumer(
            self.kafka,
            group_id=None,
            client_id=self.client_id,
            isolation_level="read_committed",
            **self.kafka.follow_options(),
        )
        await tables.start()
        try:
            tps: list[TopicPartition] = []
            for topic in self.changelog_topics:
                tps += await self._partitions(tables, topic)
            tables.assign(tps)
            await tables.seek_to_beginning(*tps)
            if self.follow_input:
                await self._drain(tables, tps, self._bootstrap_apply())
                self._bootstrap_done(time.time())
            else:
                await self._drain(tables, tps, self._apply_changelog, forever=True)
                return
        finally:
            await tables.stop()
        # phase 2: the input, from where the worker's committed state ends
        source = make_consumer(
            self.kafka, group_id=None, client_id=self.client_id, **self.kafka.follow_options()
        )
        await source.start()
        try:
            tps = []
            for topic in self.input_topics:
                tps += await self._partitions(source, topic)
            source.assign(tps)
            for tp in tps:
                if tp in committed:
                    source.seek(tp, committed[tp])
                else:
                    await source.seek_to_beginning(tp)
            log.info("%s bootstrapped from tables: %s", self.client_id, self._describe())
            await self._drain(source, tps, self._apply_input, forever=True)
        finally:
            await source.stop()

    async def _drain(
        self,
        consumer: Any,
        tps: list[TopicPartition],
        apply: Callable[[str, bytes | None, bytes | None, float], None],
        forever: bool = False,
    ) -> None:
        """Consume until every partition reached its end at the start (and on, if ``forever``)."""
        ends = await consumer.end_offsets(tps)
        pending = {tp for tp in tps if ends[tp] > await consumer.position(tp)}
        if not pending and forever:
            self._mark_caught_up()
        last_tick = time.monotonic()
        while True:
            batches = await consumer.getmany(timeout_ms=100, max_records=5000)
            self.running_again()
            now = time.time()
            for tp, records in batches.items():
                for r in records:
                    self.apply_record(apply, tp.topic, r.key, r.value, now, r.offset)
            # positions, not the last record's offset: transaction markers occupy offsets too,
            # and a busy partition may never return an empty fetch
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
            if not pending:
                if not forever:
                    return
                self._mark_caught_up()
            if self.follow_input and time.monotonic() - last_tick > 5.0:
                self._tick(now)
                last_tick = time.monotonic()

    def apply_record(
        self,
        apply: Callable[[str, bytes | None, bytes | None, float], None],
        topic: str,
        key: bytes | None,
        value: bytes | None,
        now: float,
        offset: int = -1,
    ) -> bool:
        """Fold one record; a record no fold can read (hostile key or value) is skipped and
        counted, never a poison pill that stops the replica."""
        try:
            apply(topic, key, value, now)
        except Exception as exc:
            self.bad_records += 1
            if self.bad_records <= 10 or self.bad_records % 1000 == 0:
                log.warning("%s skipped %s@%d: %r", self.client_id, topic, offset, exc)
            return False
        return True

    def _mark_caught_up(self) -> None:
        if not self.caught_up.is_set():
            log.info("%s caught up: %s", self.client_id, self._describe())
            self.caught_up.set()
