"""A router's in-memory replica of the load table and the prefix index, read from changelogs.

The replica assigns itself every partition of the two changelog topics (no consumer group: each
router holds the whole state), reads them from the beginning — compaction keeps that short — and
then follows them. It reads ``read_uncommitted``: under exactly-once, Faust's transactions commit
every ``commit_interval_s``, and routers need the index within ~1 s; an aborted write is repaired
by the re-processed one that follows it. A killed router rebuilds everything on restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from streams.folds import parse_index_key
from streams.kafka import make_consumer
from streams.prefix_index import PrefixIndex
from streams.schemas import Heartbeat
from streams.settings import KafkaSettings, WorkerSettings
from streams.tables import LOAD, PREFIX_INDEX, app_id

__all__ = ["TableReplica"]

log = logging.getLogger(__name__)


class TableReplica:
    def __init__(
        self,
        kafka: KafkaSettings,
        worker: WorkerSettings,
        client_id: str,
        isolation_level: str = "read_uncommitted",
    ) -> None:
        self.kafka = kafka
        self.isolation_level = isolation_level
        app = app_id(kafka, worker)
        self.load_topic = LOAD.changelog(app)
        self.index_topic = PREFIX_INDEX.changelog(app)
        self.client_id = client_id
        self.index = PrefixIndex()
        self.load: dict[str, Heartbeat] = {}
        self.index_updated_s: dict[str, float] = {}  # node -> when its entries last changed here
        self.caught_up = asyncio.Event()
        self.records = 0
        self.on_load: Callable[[Heartbeat, float], None] | None = None
        self.on_block: Callable[[str, int, float], None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
            except KafkaError as exc:
                log.warning("replica lost Kafka (%s); reconnecting", exc)
                await asyncio.sleep(1.0)

    async def _partitions(self, consumer: object, topic: str) -> list[TopicPartition]:
        for _ in range(600):
            parts = consumer.partitions_for_topic(topic)  # type: ignore[attr-defined]
            if parts:
                return [TopicPartition(topic, p) for p in sorted(parts)]
            await consumer._client.force_metadata_update()  # type: ignore[attr-defined]
            await asyncio.sleep(0.1)
        raise KafkaError(f"changelog {topic} does not exist (is the worker running?)")

    async def _follow(self) -> None:
        consumer = make_consumer(
            self.kafka,
            group_id=None,
            client_id=self.client_id,
            isolation_level=self.isolation_level,
            fetch_max_wait_ms=50,
        )
        await consumer.start()
        try:
            tps: list[TopicPartition] = []
            for topic in (self.load_topic, self.index_topic):
                tps += await self._partitions(consumer, topic)
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            # the rebuild replaces what this replica held before a reconnect
            self.index = PrefixIndex()
            self.load.clear()
            pending = {tp for tp, end in ends.items() if end > 0}
            if not pending:
                self.caught_up.set()
            while True:
                batches = await consumer.getmany(timeout_ms=200, max_records=5000)
                now = time.time()
                for tp, records in batches.items():
                    for r in records:
                        self._apply(tp.topic, r.key, r.value, now)
                    if tp in pending and records and records[-1].offset + 1 >= ends[tp]:
                        pending.discard(tp)
                if pending and not batches:
                    for tp in list(pending):
                        if await consumer.position(tp) >= ends[tp]:
                            pending.discard(tp)
                if not pending and not self.caught_up.is_set():
                    log.info(
                        "replica caught up: %d nodes, %d blocks", len(self.load), len(self.index)
                    )
                    self.caught_up.set()
        finally:
            await consumer.stop()

    def _apply(self, topic: str, key: bytes | None, value: bytes | None, now: float) -> None:
        if key is None:
            return
        self.records += 1
        if topic == self.index_topic:
            node, block = parse_index_key(key)
            if value is None:
                self.index.remove(node, block)
            else:
                self.index.add(node, block)
                if self.on_block is not None:
                    self.on_block(node, block, now)
            self.index_updated_s[node] = now
        else:
            node = key.decode()
            if value is None:
                self.load.pop(node, None)
                self.index.drop_node(node)
                return
            try:
                hb = Heartbeat.model_validate_json(value)
            except ValidationError:
                log.warning("ignoring an unreadable load entry for %s", node)
                return
            self.load[node] = hb
            if self.on_load is not None:
                self.on_load(hb, now)
