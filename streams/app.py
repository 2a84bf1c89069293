"""The Faust app: folds heartbeats and KV events into the load table and the prefix index.

Agents are thin: decode (invalid → dead-letter topic), call a pure fold from
:mod:`streams.folds`, write table entries. Writes for one node go to one changelog partition in
order, and the cursor is written last, so a restored table never holds a cursor ahead of its
entries. With ``exactly_once`` Faust wraps each commit interval in a Kafka transaction.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import faust

from streams.codec import decode, encode
from streams.exceptions import SchemaError
from streams.folds import KvCursor, heartbeat_is_newer, index_key, parse_index_key, plan_kv
from streams.schemas import DeadLetter, Heartbeat, KvEventBatch
from streams.settings import KafkaSettings, WorkerSettings
from streams.tables import KV_CURSOR, LOAD, PREFIX_INDEX, app_id
from streams.topics import DLQ, HEARTBEATS, KV_EVENTS

__all__ = ["build_app"]

log = logging.getLogger(__name__)
RAW: dict[str, Any] = {"key_type": bytes, "value_type": bytes}
RAW_TOPIC: dict[str, Any] = {**RAW, "key_serializer": "raw", "value_serializer": "raw"}
PRESENT = b"1"


def build_app(kafka: KafkaSettings, worker: WorkerSettings) -> faust.App:
    ns = kafka.namespace
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
    dlq = app.topic(DLQ.name(ns), **RAW_TOPIC)
    load = app.Table(LOAD.name, default=None, partitions=kafka.partitions, **RAW)
    index = app.Table(PREFIX_INDEX.name, default=None, partitions=kafka.partitions, **RAW)
    cursors = app.Table(KV_CURSOR.name, default=None, partitions=kafka.partitions, **RAW)

    # node -> blocks it holds, mirrored from ``index`` for the partitions this worker owns;
    # rebuilt from the restored table after every rebalance.
    mirror: dict[str, set[int]] = {}
    mirror_ok = False

    @app.on_rebalance_complete.connect
    def _invalidate(*_: Any, **__: Any) -> None:
        nonlocal mirror_ok
        mirror_ok = False

    def node_blocks(node: str) -> set[int]:
        nonlocal mirror_ok
        if not mirror_ok:
            mirror.clear()
            for key in list(index.keys()):
                n, block = parse_index_key(key)
                mirror.setdefault(n, set()).add(block)
            mirror_ok = True
        return mirror.setdefault(node, set())

    async def dead_letter(event: Any, error: str, consumer: str) -> None:
        msg = event.message
        raw = event.value if isinstance(event.value, bytes) else b""
        letter = DeadLetter(
            source_topic=msg.topic,
            partition=msg.partition,
            offset=msg.offset,
            key=event.key.decode("utf-8", "replace") if isinstance(event.key, bytes) else None,
            value=raw.decode("utf-8", "replace"),
            error=error,
            consumer=consumer,
            ts=time.time(),
        )
        log.warning("dead-lettering %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, error)
        await dlq.send(key=msg.topic.encode(), value=encode(letter))

    @app.agent(heartbeats)
    async def fold_heartbeats(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            try:
                hb = decode(Heartbeat, event.value)
            except SchemaError as exc:
                await dead_letter(event, str(exc), "worker.load")
                continue
            raw = load.get(hb.node_id.encode())
            prev = Heartbeat.model_validate_json(raw) if raw else None
            if heartbeat_is_newer(prev, hb):
                load[hb.node_id.encode()] = event.value

    @app.agent(kv_events)
    async def fold_kv_events(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            try:
                batch = decode(KvEventBatch, event.value)
            except SchemaError as exc:
                await dead_letter(event, str(exc), "worker.prefix_index")
                continue
            node = batch.node_id
            raw = cursors.get(node.encode())
            cursor = KvCursor.decode(raw) if raw else None
            current = node_blocks(node)
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

    return app
