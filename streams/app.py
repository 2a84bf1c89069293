"""The Faust app: folds heartbeats and KV events into the load table and the prefix index.

Agents are thin: decode (invalid → dead-letter topic), call a pure fold from
:mod:`streams.folds`, write table entries. Writes for one node go to one changelog partition in
order, and the cursor is written last, so a restored table never holds a cursor ahead of its
entries. With ``exactly_once`` Faust wraps each commit interval in a Kafka transaction.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, TypeVar

import faust

from streams.codec import decode, encode
from streams.exceptions import SchemaError
from streams.folds import KvCursor, index_key, is_newer, parse_index_key, plan_kv
from streams.kafka import KafkaBus
from streams.kafka import dead_letter as kafka_dead_letter
from streams.ledger import ledger_fold
from streams.schemas import Heartbeat, KvEventBatch, LedgerEvent, Message
from streams.settings import KafkaSettings, WorkerSettings
from streams.tables import KV_CURSOR, KV_LEDGER, LOAD, PREFIX_INDEX, app_id
from streams.topics import DLQ, HEARTBEATS, KV_EVENTS, LEDGER

__all__ = ["build_app"]

log = logging.getLogger(__name__)
RAW: dict[str, Any] = {"key_type": bytes, "value_type": bytes}
RAW_TOPIC: dict[str, Any] = {**RAW, "key_serializer": "raw", "value_serializer": "raw"}
PRESENT = b"1"
M = TypeVar("M", bound=Message)


def flush_before_transaction_commit(timeout_s: float = 30.0) -> None:
    """Make Faust's exactly-once commits carry the table writes they cover.

    faust-streaming 0.15.3 commits a transaction (input offsets + end of transaction) without
    first draining its own producer buffer: ``Consumer._commit_offsets`` calls
    ``producer.flush()`` only outside transactions. Changelog records still in that buffer are
    sent after the commit, into the next transaction, so a worker that dies in between has
    committed input offsets whose table writes are lost. This waits, before each commit, until
    the record that was last in the (FIFO) buffer when the commit started has reached Kafka: every
    record buffered before it has then been handed to aiokafka, which sends what it holds before
    it ends a transaction. Records buffered later belong to later offsets and go to the next
    transaction. (Faust's own ``flush()`` would wait for an empty buffer, which under steady
    table writes holds every commit back.) Idempotent.
    """
    from faust.transport.consumer import TransactionManager

    commit = TransactionManager.commit
    if getattr(commit, "flushes_first", False):
        return

    async def flushed_commit(
        self: TransactionManager, offsets: Any, start_new_transaction: bool = True
    ) -> bool:
        await buffered_records_sent(self.app.producer, timeout_s)
        return await commit(self, offsets, start_new_transaction=start_new_transaction)

    flushed_commit.flushes_first = True  # type: ignore[attr-defined]
    TransactionManager.commit = flushed_commit  # type: ignore[method-assign]


async def buffered_records_sent(producer: Any, timeout_s: float) -> None:
    """Wait until the records in ``producer``'s buffer now have been sent (see above)."""
    if producer.app.conf.producer_threaded:  # another queue: drain the whole buffer
        await producer.flush()
        return
    queued = getattr(producer.buffer.pending, "_queue", None)
    if not queued:
        return
    last = queued[-1]
    try:
        await asyncio.wait_for(asyncio.shield(last), timeout_s)
    except TimeoutError:
        log.warning("a buffered table write was not sent within %.0f s; committing", timeout_s)
    except Exception as exc:
        log.warning("a buffered table write failed before the commit: %s", exc)


def build_app(kafka: KafkaSettings, worker: WorkerSettings) -> faust.App:
    ns = kafka.namespace
    if worker.exactly_once:
        flush_before_transaction_commit()
    # Faust creates its data directory without parents: started anywhere, it must exist
    Path(worker.data_dir).mkdir(parents=True, exist_ok=True)
    app = faust.App(
        app_id(kafka, worker),
        broker=f"kafka://{kafka.bootstrap_servers}",
        store="memory://",
        processing_guarantee="exactly_once" if worker.exactly_once else "at_least_once",
        topic_partitions=kafka.partitions,
        topic_replication_factor=kafka.replication_factor,
        web_enabled=True,
        web_bind=worker.web_host,
        web_port=worker.web_port,
        web_in_thread=False,
        broker_commit_interval=worker.commit_interval_s,
        broker_session_timeout=worker.session_timeout_s,
        broker_rebalance_timeout=worker.rebalance_timeout_s,
        broker_heartbeat_interval=worker.heartbeat_interval_s,
        consumer_auto_offset_reset="earliest",
        producer_linger_ms=5,
        producer_max_request_size=8 * 1024 * 1024,
        table_standby_replicas=0,
        datadir=worker.data_dir,
        key_serializer="raw",
        value_serializer="raw",
    )
    heartbeats = app.topic(HEARTBEATS.name(ns), **RAW_TOPIC)
    kv_events = app.topic(KV_EVENTS.name(ns), **RAW_TOPIC)
    ledger_topic = app.topic(LEDGER.name(ns), **RAW_TOPIC)
    dlq = app.topic(DLQ.name(ns), **RAW_TOPIC)
    load = app.Table(LOAD.name, default=None, partitions=kafka.partitions, **RAW)
    index = app.Table(PREFIX_INDEX.name, default=None, partitions=kafka.partitions, **RAW)
    cursors = app.Table(KV_CURSOR.name, default=None, partitions=kafka.partitions, **RAW)
    ledger = app.Table(KV_LEDGER.name, default=None, partitions=kafka.partitions, **RAW)

    # In-memory mirrors of the tables for the partitions this worker owns (node -> blocks, node ->
    # last heartbeat (epoch, seq)), rebuilt from the restored tables after every rebalance.
    mirror: dict[str, set[int]] = {}
    beats: dict[str, tuple[str, int, float]] = {}
    mirror_ok = False

    @app.on_rebalance_complete.connect
    def _invalidate(*_: Any, **__: Any) -> None:
        nonlocal mirror_ok
        mirror_ok = False

    def rebuild() -> None:
        nonlocal mirror_ok
        if mirror_ok:
            return
        mirror.clear()
        beats.clear()
        for key in list(index.keys()):
            n, block = parse_index_key(key)
            mirror.setdefault(n, set()).add(block)
        for key, value in list(load.items()):
            hb = Heartbeat.model_validate_json(value)
            beats[key.decode()] = (hb.epoch, hb.seq, hb.ts)
        mirror_ok = True

    async def dead_letter(event: Any, error: str, consumer: str) -> None:
        msg = event.message
        log.warning("dead-lettering %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, error)
        letter = kafka_dead_letter(msg, error, consumer)
        await dlq.send(key=msg.topic.encode(), value=encode(letter))

    def forget(node: str) -> None:
        """A node retired (tombstone on the input): drop its entries from every table."""
        rebuild()
        for block in mirror.pop(node, set()):
            del index[index_key(node, block)]
        if node in beats:
            del load[node.encode()]
            del beats[node]
        if cursors.get(node.encode()) is not None:
            del cursors[node.encode()]

    async def node_message(event: Any, model: type[M], consumer: str) -> M | None:
        """The event's message, or None when it was a retirement (handled here) or invalid
        (dead-lettered)."""
        key = event.key.decode("utf-8", "replace") if isinstance(event.key, bytes) else None
        if event.value is None and key is not None:
            forget(key)
            return None
        try:
            msg = decode(model, event.value)
        except SchemaError as exc:
            await dead_letter(event, str(exc), consumer)
            return None
        if key != getattr(msg, "node_id", None):
            await dead_letter(event, "the message key must be the node id", consumer)
            return None
        rebuild()
        return msg

    @app.agent(heartbeats)
    async def fold_heartbeats(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            hb = await node_message(event, Heartbeat, "worker.load")
            if hb is None:
                continue
            prev = beats.get(hb.node_id)
            if is_newer(None if prev is None else prev[:2], (hb.epoch, hb.seq)):
                load[hb.node_id.encode()] = event.value
                beats[hb.node_id] = (hb.epoch, hb.seq, hb.ts)

    @app.agent(kv_events)
    async def fold_kv_events(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            batch = await node_message(event, KvEventBatch, "worker.prefix_index")
            if batch is None:
                continue
            node = batch.node_id
            raw = cursors.get(node.encode())
            cursor = KvCursor.decode(raw) if raw else None
            current = mirror.setdefault(node, set())
            plan = plan_kv(cursor, current, batch)
            if not plan.apply:
                continue
            if plan.gap:
                log.warning("KV batches of %s were lost before %s/%d", node, batch.epoch, batch.seq)
            for block in plan.deletes:
                del index[index_key(node, block)]
                current.discard(block)
            for block in plan.upserts:
                index[index_key(node, block)] = PRESENT
                current.add(block)
            cursors[node.encode()] = plan.cursor.encode()

    @app.agent(ledger_topic)
    async def fold_ledger(stream: faust.StreamT[bytes]) -> None:
        """One entry per open reservation: set on reserve, its lease moved on renew, deleted on
        release or expire (all idempotent, so a replay folds to the same table)."""
        async for event in stream.events():
            try:
                ev = decode(LedgerEvent, event.value)
            except SchemaError as exc:
                await dead_letter(event, str(exc), "worker.kv_ledger")
                continue
            key = ev.reservation_id.encode()
            if ev.kind == "reserve":
                ledger[key] = event.value
                continue
            held = ledger.get(key)
            if held is None:  # closed already (or never opened): nothing to change
                continue
            entry = ledger_fold(ev, LedgerEvent.model_validate_json(held))
            if entry is None:
                del ledger[key]
            else:  # a renew: the open entry with its new lease
                ledger[key] = entry.model_dump_json().encode()

    reaper: KafkaBus | None = None

    @app.timer(interval=worker.reap_interval_s)  # type: ignore[untyped-decorator]
    async def reap() -> None:
        """Retire nodes silent for ``node_ttl_s``: a tombstone on both input topics, which the
        agents above (and every router) fold like any other event."""
        nonlocal reaper
        if not mirror_ok:
            return
        now = time.time()
        dead = [n for n, (_, _, ts) in beats.items() if now - ts > worker.node_ttl_s]
        if not dead:
            return
        if reaper is None:
            reaper = KafkaBus(kafka, f"{app.conf.id}-reaper")
            await reaper.start()
        for node in dead:
            log.info("retiring node %s (silent for %.0f s)", node, now - beats[node][2])
            await reaper.publish_raw(HEARTBEATS.name(ns), node.encode(), None)
            await reaper.publish_raw(KV_EVENTS.name(ns), node.encode(), None)
        await reaper.flush()

    return app
