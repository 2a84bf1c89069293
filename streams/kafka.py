"""The Kafka edge: producer, topic creation, consumers with a dead-letter path.

aiokafka errors are wrapped in :class:`StreamError` here, so no caller handles aiokafka types.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from pydantic import BaseModel

from streams.codec import decode, encode, encode_key
from streams.exceptions import SchemaError, StreamError
from streams.schemas import DeadLetter
from streams.settings import KafkaSettings
from streams.topics import ALL_TOPICS, DLQ, TopicSpec

__all__ = ["KafkaBus", "dead_letter", "decode_or_dead_letter", "ensure_topics", "make_consumer"]

log = logging.getLogger(__name__)


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
    except KafkaError as exc:
        raise StreamError(f"cannot create topics on {settings.bootstrap_servers}: {exc}") from exc
    finally:
        await admin.close()


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


class KafkaBus:
    """One producer per process; ``publish`` never blocks the caller on the broker."""

    def __init__(self, settings: KafkaSettings, client_id: str, *, linger_ms: int = 5) -> None:
        self.settings = settings
        self.client_id = client_id
        self._linger_ms = linger_ms
        self._producer_obj: AIOKafkaProducer | None = None
        self._pending: set[asyncio.Future[Any]] = set()
        self.send_errors = 0

    def topic(self, spec: TopicSpec) -> str:
        return spec.name(self.settings.namespace)

    @property
    def _producer(self) -> AIOKafkaProducer:
        if self._producer_obj is None:
            raise StreamError("KafkaBus.start() was not awaited")
        return self._producer_obj

    async def start(self) -> None:
        self._producer_obj = AIOKafkaProducer(
            client_id=self.client_id,
            linger_ms=self._linger_ms,
            acks="all",
            enable_idempotence=True,
            max_batch_size=1 << 20,
            max_request_size=8 << 20,
            **self.settings.client_options(),
        )
        try:
            await self._producer.start()
        except KafkaError as exc:
            raise StreamError(f"cannot reach Kafka at {self.settings.bootstrap_servers}") from exc

    async def stop(self) -> None:
        await self.flush()
        await self._producer.stop()

    async def flush(self) -> None:
        try:
            await self._producer.flush()
        except KafkaError as exc:
            raise StreamError(f"flush failed: {exc}") from exc

    async def send(self, spec: TopicSpec, key: str | None, value: BaseModel) -> None:
        """Send and wait for the broker's acknowledgement."""
        try:
            await self._producer.send_and_wait(self.topic(spec), encode(value), encode_key(key))
        except KafkaError as exc:
            raise StreamError(f"send to {self.topic(spec)} failed: {exc}") from exc

    async def publish(self, spec: TopicSpec, key: str | None, value: BaseModel) -> None:
        """Hand the message to the producer's buffer; delivery errors are counted and logged."""
        await self.publish_raw(self.topic(spec), encode_key(key), encode(value))

    async def publish_raw(self, topic: str, key: bytes | None, value: bytes | None) -> None:
        try:
            fut = await self._producer.send(topic, value, key)
        except KafkaError as exc:
            self.send_errors += 1
            log.warning("send to %s failed: %s", topic, exc)
            return
        self._pending.add(fut)
        fut.add_done_callback(self._delivered)

    def _delivered(self, fut: asyncio.Future[Any]) -> None:
        self._pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            self.send_errors += 1
            log.warning("delivery failed: %s", fut.exception())


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
