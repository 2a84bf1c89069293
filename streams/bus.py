"""kvgate's producer: :class:`KafkaBus`, an outbox that publishing never waits on, handed to
the broker in the background as one record batch per partition."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections import Counter, deque
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordTooLargeError
from pydantic import BaseModel

from streams.codec import encode, encode_key
from streams.controlauth import ControlAuth
from streams.exceptions import StreamError
from streams.partitioner import partition_of
from streams.schemas import ControlMessage
from streams.settings import KafkaSettings
from streams.topics import TopicSpec

__all__ = ["KafkaBus"]

log = logging.getLogger(__name__)

# what a broker never takes, however often it is sent: retrying it would jam the outbox
_NEVER_TAKEN = (MessageSizeTooLargeError, RecordTooLargeError)
# a message larger than this is sent on its own (the broker may refuse it; alone, it is set
# aside without holding up the small ones it would have shared a batch with)
SINGLE_BYTES = 256 << 10

Item = tuple[str, bytes | None, bytes | None]  # topic, key, value (None: a tombstone)


class KafkaBus:
    """One producer per process. ``publish`` never waits: messages go to a bounded outbox that
    a background task hands to the producer (retrying what the broker did not take, in order);
    when the outbox is full, new messages are dropped and counted per topic. ``send`` waits for
    the broker's acknowledgement (for callers that need it)."""

    def __init__(self, settings: KafkaSettings, client_id: str, *, linger_ms: int = 5) -> None:
        self.settings = settings
        self.client_id = client_id
        # every control message this process publishes is signed (streams/controlauth.py)
        self.signer = ControlAuth(settings.control_keys, settings.control_key_id)
        # the outbox is handed over every linger_ms, all at once: every partition's batch is
        # then ready at the same moment and goes in one produce request per broker (the
        # producer's own linger runs per partition, so its requests would not coalesce)
        self._linger_s = linger_ms / 1000
        self._producer_obj: AIOKafkaProducer | None = None
        self._outbox: deque[Item] = deque()
        self._alone: set[int] = set()  # ids of queued messages to send on their own
        self._outbox_bytes = 0
        self._wake = asyncio.Event()
        self._inflight = 0
        self._drainer: asyncio.Task[None] | None = None
        self.send_errors = 0
        self.retried = 0
        self.dropped: Counter[str] = Counter()  # topic -> messages dropped (outbox full)
        # topic -> messages the broker will never take (too large): set aside, never retried
        self.refused: Counter[str] = Counter()
        self.delivered = 0
        self.last_delivery_at: float | None = None

    def topic(self, spec: TopicSpec) -> str:
        return spec.name(self.settings.namespace)

    @property
    def _producer(self) -> AIOKafkaProducer:
        if self._producer_obj is None:
            raise StreamError("KafkaBus.start() was not awaited")
        return self._producer_obj

    @property
    def queued(self) -> int:
        """Messages published but not yet handed to the broker (or being retried)."""
        return len(self._outbox) + self._inflight

    async def start(self) -> None:
        self._producer_obj = AIOKafkaProducer(
            client_id=self.client_id,
            linger_ms=0,
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
        self._drainer = asyncio.create_task(self._drain())

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (for at most ``timeout_s``), then stop."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.flush()
        except (TimeoutError, StreamError) as exc:
            log.warning("stopping with %d messages undelivered: %r", self.queued, exc)
        if self._drainer is not None:
            self._drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drainer
        await self._producer.stop()

    async def flush(self) -> None:
        """Wait until everything published so far has reached the broker."""
        while self._outbox or self._inflight:
            if self._drainer is None or self._drainer.done():
                raise StreamError("the bus is not running")
            await asyncio.sleep(0.005)
        try:
            await self._producer.flush()
        except KafkaError as exc:
            raise StreamError(f"flush failed: {exc}") from exc

    async def send(self, spec: TopicSpec, key: str | None, value: BaseModel) -> None:
        """Send and wait for the broker's acknowledgement."""
        if isinstance(value, ControlMessage):
            value = self.signer.sign(value)
        try:
            await self._producer.send_and_wait(self.topic(spec), encode(value), encode_key(key))
        except KafkaError as exc:
            raise StreamError(f"send to {self.topic(spec)} failed: {exc}") from exc

    async def publish(self, spec: TopicSpec, key: str | None, value: BaseModel) -> None:
        """Queue the message for the broker; returns at once (see the class docstring)."""
        self.post(spec, key, value)

    def post(self, spec: TopicSpec, key: str | None, value: BaseModel | None) -> bool:
        """:meth:`publish` for code that is not a coroutine (None: a tombstone)."""
        if isinstance(value, ControlMessage):
            value = self.signer.sign(value)
        return self.enqueue(
            self.topic(spec), encode_key(key), encode(value) if value is not None else None
        )

    def post_json(self, spec: TopicSpec, key: str | None, value: bytes) -> bool:
        """:meth:`post` for a record already rendered (streams/trusted.py)."""
        return self.enqueue(self.topic(spec), encode_key(key), value)

    async def publish_raw(self, topic: str, key: bytes | None, value: bytes | None) -> None:
        self.enqueue(topic, key, value)

    def enqueue(self, topic: str, key: bytes | None, value: bytes | None) -> bool:
        """Queue one message; False (and counted in ``dropped``) when the outbox is full."""
        item = (topic, key, value)
        size = _size(item)
        s = self.settings
        if len(self._outbox) >= s.outbox_max_messages or self._outbox_bytes + size > (
            s.outbox_max_bytes
        ):
            if not self.dropped:
                log.warning("Kafka outbox full (%d messages): dropping", len(self._outbox))
            self.dropped[topic] += 1
            return False
        self._outbox.append(item)
        self._outbox_bytes += size
        self._wake.set()
        return True

    def _take(self) -> Item:
        item = self._outbox.popleft()
        self._outbox_bytes -= _size(item)
        return item

    def _requeue(self, items: list[Item]) -> None:
        """Back to the front, in their order — the broker did not take them."""
        self._inflight -= len(items)
        self._outbox.extendleft(reversed(items))
        self._outbox_bytes += sum(_size(i) for i in items)
        self.retried += len(items)
        self._wake.set()

    async def _drain(self) -> None:
        backoff = 0.05
        while True:
            if not self._outbox:
                self._wake.clear()
                await self._wake.wait()
                if self._linger_s:
                    await asyncio.sleep(self._linger_s)  # what else comes meanwhile goes along
                continue
            items = [self._take() for _ in range(len(self._outbox))]
            self._inflight += len(items)  # until delivered (or back in the outbox)
            try:
                await self._hand_over(items)
            except KafkaError as exc:  # no metadata / buffer full for too long: broker away
                self.send_errors += 1
                if backoff >= 1.0:
                    log.warning("Kafka does not take messages (%s); %d queued", exc, self.queued)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            backoff = 0.05

    async def _hand_over(self, items: list[Item]) -> None:
        """``items`` to the producer, in order, as one record batch per partition (aiokafka's
        record encoder fills it; one future per batch): per message, ``send`` costs a
        coroutine, a partitioner call, a metadata check, an accumulator entry and a future —
        on a router, about a tenth of a request's CPU for its four records. A message over
        :data:`SINGLE_BYTES`, or one whose batch the broker refused whole, goes on its own.
        On a :class:`KafkaError` what was not handed over goes back to the front of the outbox
        and the error is raised."""
        producer = self._producer
        partitions: dict[str, list[int]] = {}
        sticky: dict[str, int] = {}  # the partition of this pass's unkeyed messages, per topic
        batches: dict[tuple[str, int], tuple[Any, list[Item]]] = {}
        looked = 0  # items[:looked] are handed over or in one of ``batches``
        try:
            for item in items:
                topic, key, value = item
                if _size(item) > SINGLE_BYTES or id(item) in self._alone:
                    await self._submit_all(batches)  # what came before it goes first
                    await self._send_alone(item)
                    looked += 1
                    continue
                parts = partitions.get(topic)
                if parts is None:
                    parts = partitions[topic] = sorted(await producer.partitions_for(topic))
                if key is not None:
                    p = parts[partition_of(key, len(parts))]
                elif (p := sticky.get(topic, -1)) < 0:
                    p = sticky[topic] = random.choice(parts)
                tp = (topic, p)
                entry = batches.get(tp)
                if entry is None:
                    entry = batches[tp] = (producer.create_batch(), [])
                if entry[0].append(key=key, value=value, timestamp=None) is None:  # full
                    await self._submit(tp, entry)
                    entry = batches[tp] = (producer.create_batch(), [])
                    entry[0].append(key=key, value=value, timestamp=None)  # small: fits
                entry[1].append(item)
                looked += 1
            await self._submit_all(batches)
        except KafkaError:
            waiting = {id(i) for _, batch in batches.values() for i in batch}
            self._requeue([i for i in items[:looked] if id(i) in waiting] + items[looked:])
            raise

    async def _submit_all(self, batches: dict[tuple[str, int], tuple[Any, list[Item]]]) -> None:
        for tp in list(batches):
            await self._submit(tp, batches[tp])
            del batches[tp]

    async def _submit(self, tp: tuple[str, int], entry: tuple[Any, list[Item]]) -> None:
        builder, batch = entry
        fut = await self._producer.send_batch(builder, tp[0], partition=tp[1])
        fut.add_done_callback(functools.partial(self._delivered, batch))

    async def _send_alone(self, item: Item) -> None:
        topic, key, value = item
        try:
            fut = await self._producer.send(topic, value, key)
        except _NEVER_TAKEN as exc:  # larger than the producer may send: never will be
            self._alone.discard(id(item))
            self._refuse(item, exc)
            return
        self._alone.discard(id(item))
        fut.add_done_callback(functools.partial(self._delivered, [item]))

    def _delivered(self, batch: list[Item], fut: asyncio.Future[Any]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if isinstance(exc, _NEVER_TAKEN):
            if len(batch) == 1:
                self._refuse(batch[0], exc)
                return
            # refused whole: each goes again on its own, and only what is too large is dropped
            self._alone.update(id(i) for i in batch)
            self._requeue(batch)
            return
        if fut.cancelled() or exc is not None:
            self.send_errors += 1
            log.warning("delivery to %s failed (%r); retrying", batch[0][0], exc)
            self._requeue(batch)
            return
        self._inflight -= len(batch)
        self.delivered += len(batch)
        self.last_delivery_at = time.time()

    def _refuse(self, item: Item, exc: BaseException | None) -> None:
        """A message the broker (or the producer) will never take — retried, it would hold up
        every message behind it: counted per topic in ``refused`` and set aside."""
        self._inflight -= 1
        self.refused[item[0]] += 1
        size = _size(item)
        log.error("Kafka refuses a %d-byte message to %s (%r): dropped", size, item[0], exc)


def _size(item: Item) -> int:
    return len(item[2] or b"") + len(item[1] or b"")
