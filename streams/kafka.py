"""The Kafka edge: producer, topic creation, consumers with a dead-letter path.

aiokafka errors are wrapped in :class:`StreamError` here, so no caller handles aiokafka types.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from pydantic import BaseModel

from streams.bus import KafkaBus
from streams.codec import decode
from streams.exceptions import SchemaError, StreamError
from streams.schemas import DeadLetter
from streams.settings import KafkaSettings
from streams.topics import ALL_TOPICS, DLQ, TopicSpec

__all__ = [
    "KafkaBus",
    "OffsetProbe",
    "dead_letter",
    "decode_or_dead_letter",
    "delete_namespace_topics",
    "ensure_topics",
    "make_consumer",
]

log = logging.getLogger(__name__)


async def delete_namespace_topics(settings: KafkaSettings, timeout_s: float = 30.0) -> int:
    """Delete every topic of ``settings.namespace``: kvgate's (``<namespace>.<topic>``) and the
    worker's (``<namespace>-streams-…``: changelogs, Faust's own). For benchmarks and tests that
    mint a namespace per run: a broker that keeps them all ends up with thousands of partitions
    whose upkeep slows every later measurement. Returns how many were deleted."""
    ns = settings.namespace
    admin = AIOKafkaAdminClient(**settings.client_options())
    try:
        await admin.start()
        names = [t for t in await admin.list_topics() if t.startswith((f"{ns}.", f"{ns}-"))]
        if names:
            await admin.delete_topics(names, timeout_ms=int(timeout_s * 1000))
        return len(names)
    except KafkaError as exc:
        raise StreamError(f"cannot delete the topics of {ns}: {exc}") from exc
    finally:
        await admin.close()


async def ensure_topics(settings: KafkaSettings, specs: Iterable[TopicSpec] = ALL_TOPICS) -> None:
    """Create the topics that do not exist yet (idempotent)."""
    admin = AIOKafkaAdminClient(**settings.client_options())
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(
                name=spec.name(settings.namespace),
                num_partitions=spec.partitions or settings.partitions,
                replication_factor=settings.replication_factor,
                topic_configs=spec.configs(),
            )
            for spec in specs
            if spec.name(settings.namespace) not in existing
        ]
        if wanted:
            try:
                await admin.create_topics(wanted)
            except TopicAlreadyExistsError:
                pass
            await _wait_for_leaders(admin, [t.name for t in wanted])
        # every compact-only topic, also one this call found "new" but that another process
        # had just created (list_topics can lag behind a creation)
        compacted = [s for s in specs if "delete" not in s.cleanup_policy]
        if compacted:
            await _align_cleanup_policy(admin, settings.namespace, compacted)
    except KafkaError as exc:
        raise StreamError(f"cannot create topics on {settings.bootstrap_servers}: {exc}") from exc
    finally:
        await admin.close()


async def _align_cleanup_policy(
    admin: AIOKafkaAdminClient, namespace: str, specs: list[TopicSpec], wait_s: float = 10.0
) -> None:
    """Topics that must never lose data to retention (the control topic's weights) are
    compacted only; an existing one created with another policy (an older kvgate made the
    control topic ``compact,delete``) is set right. Returns once the broker reports the policy
    (a config change reaches the broker a moment after the controller accepted it)."""
    names = {s.name(namespace): s for s in specs}
    altered: set[str] = set()
    deadline = time.monotonic() + wait_s
    while True:
        wrong, unknown = await _policies_differing(admin, names)
        for name in wrong - altered:
            spec = names[name]
            log.warning("topic %s: cleanup.policy -> %s", name, spec.cleanup_policy)
            await admin.alter_configs(
                [ConfigResource(ConfigResourceType.TOPIC, name, configs=spec.configs())]
            )
            altered.add(name)
        if (not wrong & altered and not unknown) or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.1)


async def _policies_differing(
    admin: AIOKafkaAdminClient, names: dict[str, TopicSpec]
) -> tuple[set[str], set[str]]:
    """The topics of ``names`` whose cleanup.policy is not their spec's, and those the broker
    does not know yet (just created)."""
    resources = [
        ConfigResource(ConfigResourceType.TOPIC, name, configs={"cleanup.policy": None})
        for name in names
    ]
    wrong: set[str] = set()
    unknown: set[str] = set()
    for response in await admin.describe_configs(resources):
        for resource in response.resources:
            if resource[0]:  # an error code: not (yet) known to the broker
                unknown.add(resource[3])
                continue
            name, entries = resource[3], resource[4]
            current = next((e[1] for e in entries if e[0] == "cleanup.policy"), None)
            spec = names.get(name)
            if spec is not None and current != spec.cleanup_policy:
                wrong.add(name)
    return wrong, unknown


async def _wait_for_leaders(admin: AIOKafkaAdminClient, names: list[str]) -> None:
    """New topics answer fetches only once every partition has a leader."""
    for _ in range(100):
        described = await admin.describe_topics(names)
        if all(
            t.get("error_code", 0) == 0
            and t.get("partitions")
            and all(p.get("leader", -1) >= 0 for p in t["partitions"])
            for t in described
        ):
            return
        await asyncio.sleep(0.1)


def make_consumer(
    settings: KafkaSettings,
    *topics: str,
    group_id: str | None,
    client_id: str,
    **options: Any,
) -> AIOKafkaConsumer:
    defaults: dict[str, Any] = {
        "auto_offset_reset": "earliest",
        "enable_auto_commit": False,
        "max_poll_records": 2000,
    }
    defaults.update(options)
    return AIOKafkaConsumer(
        *topics, group_id=group_id, client_id=client_id, **settings.client_options(), **defaults
    )


class OffsetProbe:
    """Asks the broker where the first record at or after an offset is (records that do not
    exist there: transaction markers, aborted records with ``read_committed``, records removed
    by retention). One consumer, started on first use and kept; every question is bounded in
    time, and a failure answers None (the caller reads the partition again, the safe choice)."""

    def __init__(
        self, settings: KafkaSettings, client_id: str, read_committed: bool, timeout_s: float = 5.0
    ) -> None:
        self.settings = settings
        self.client_id = client_id
        self.isolation = "read_committed" if read_committed else "read_uncommitted"
        self.timeout_s = timeout_s
        self._consumer: AIOKafkaConsumer | None = None

    async def first_offset(self, topic: str, partition: int, offset: int) -> int | None:
        try:
            return await asyncio.wait_for(self._first(topic, partition, offset), self.timeout_s)
        except (TimeoutError, KafkaError, OSError) as exc:
            log.warning("could not read %s[%d] at %d: %r", topic, partition, offset, exc)
            return None

    async def _first(self, topic: str, partition: int, offset: int) -> int | None:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                **self.settings.client_options(),
                client_id=self.client_id,
                enable_auto_commit=False,
                isolation_level=self.isolation,
            )
            await consumer.start()
            self._consumer = consumer
        tp = TopicPartition(topic, partition)
        self._consumer.assign([tp])
        self._consumer.seek(tp, offset)
        wait_ms = int(self.timeout_s * 500)
        batch = await self._consumer.getmany(tp, timeout_ms=wait_ms, max_records=1)
        records = batch.get(tp)
        return int(records[0].offset) if records else None

    async def stop(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()
            self._consumer = None


def dead_letter(record: Any, error: str, consumer: str) -> DeadLetter:
    """A dead letter for a consumed record (aiokafka's ConsumerRecord or Faust's Message: both
    have topic, partition, offset, key and value)."""
    raw = record.value if isinstance(record.value, bytes) else b""
    key = record.key.decode("utf-8", "replace") if isinstance(record.key, bytes) else None
    return DeadLetter(
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=key,
        value=raw.decode("utf-8", "replace"),
        error=error,
        consumer=consumer,
        ts=time.time(),
    )


async def decode_or_dead_letter(
    bus: KafkaBus,
    spec: TopicSpec,
    record: ConsumerRecord[bytes, bytes],
    consumer: str,
) -> BaseModel | None:
    """Decode ``record`` as ``spec``'s value model, or park it on the dead-letter topic."""
    try:
        return decode(spec.value_model, record.value)
    except SchemaError as exc:
        log.warning(
            "dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, exc
        )
        await bus.publish(DLQ, record.topic, dead_letter(record, str(exc), consumer))
        return None
