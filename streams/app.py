"""The Faust app: folds heartbeats and KV events into the load table and the prefix index.

Agents are thin: decode (invalid → dead-letter topic), call a pure fold from
:mod:`streams.folds`, write table entries. Writes for one node go to one changelog partition in
order, and the cursor is written last, so a restored table never holds a cursor ahead of its
entries. With ``exactly_once`` Faust wraps each commit interval in a Kafka transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
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
    committed input offsets whose table writes are lost. This waits, before each commit
    (periodic, rebalance and the final one at shutdown alike), until the record that was
    buffered last when the commit started has reached Kafka: the buffer is FIFO, so every record
    buffered before it has then been handed to aiokafka, which sends what it holds before it ends
    a transaction. Records buffered later belong to later offsets and go to the next transaction.
    (Faust's own ``flush()`` would wait for an empty buffer, which under steady table writes
    holds every commit back.)

    The record to wait for is remembered when it is buffered, not looked up in the buffer's
    queue: the buffer's sender takes a record off the queue *before* handing it to aiokafka
    (which can wait when a partition's batch is full), so a queue that looks empty may still have
    a record in flight. If that record fails or is not sent in time, the commit is refused (the
    worker stops and the input is folded again): committing would lose table writes. Idempotent.
    """
    from faust.transport.consumer import TransactionManager
    from faust.transport.producer import ProducerBuffer

    put = ProducerBuffer.put
    if not getattr(put, "remembers_last", False):

        def remembering_put(self: ProducerBuffer, fut: Any) -> None:
            self.last_buffered = fut  # type: ignore[attr-defined]
            put(self, fut)

        remembering_put.remembers_last = True  # type: ignore[attr-defined]
        ProducerBuffer.put = remembering_put  # type: ignore[method-assign]

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


def restore_only_settled_changelogs(kafka: KafkaSettings, timeout_s: float = 10.0) -> None:
    """Make Faust's table recovery read every committed changelog record.

    With exactly-once the worker reads changelogs ``read_committed``, and Faust takes the
    partitions' end offsets at the start of recovery as the point where the tables are restored.
    For a ``read_committed`` reader that end is the *last stable offset*: it stops at the first
    transaction still open. A worker that just committed its last transaction and stopped
    (SIGTERM) leaves that transaction committed at the coordinator but its markers not yet
    written to every partition; the input offsets it committed are visible a moment before its
    table writes are. A successor that restores in that moment stops short of the writes yet
    resumes the input after them: the writes are never folded again (a KV cursor behind its
    input, blocks whose removals were committed still in the index). This waits, before
    recovery reads the end offsets, until no transaction is open on the changelog partitions
    this worker was newly given (the last stable offset equals the high watermark; on the
    partitions it kept, an open transaction is its own and would never settle). Open
    transactions of a dead worker are aborted when this worker's transactional producers start,
    which Faust does before recovery, so the wait is short (commit markers take milliseconds); it
    gives up after ``timeout_s`` (recovery then proceeds as before, and says so). Idempotent."""
    from faust.tables.recovery import Recovery

    build = Recovery._build_highwaters
    if getattr(build, "waits_for_settled", False):
        return

    owned: dict[tuple[int, str], set[Any]] = {}  # (recovery, title) -> partitions last time

    async def settled_highwaters(
        self: Recovery, consumer: Any, tps: Any, destination: Any, title: str
    ) -> None:
        # only partitions this worker did not hold at its previous recovery can have someone
        # else's transaction open; on the ones it kept, an open transaction is its own
        before = owned.get((id(self), title), set())
        new = set(tps) - before
        if new:
            await changelogs_settled(kafka, consumer, new, timeout_s)
        owned[(id(self), title)] = set(tps)
        await build(self, consumer, tps, destination, title)

    settled_highwaters.waits_for_settled = True  # type: ignore[attr-defined]
    Recovery._build_highwaters = settled_highwaters  # type: ignore[method-assign]


async def changelogs_settled(
    kafka: KafkaSettings, consumer: Any, tps: set[Any], timeout_s: float
) -> None:
    """Wait until ``consumer``'s (read_committed) end offsets of ``tps`` reach their high
    watermarks (see :func:`restore_only_settled_changelogs`)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    probe = AIOKafkaConsumer(
        **kafka.client_options(),
        client_id="kvgate-worker-recovery-probe",
        isolation_level="read_uncommitted",
        enable_auto_commit=False,
    )
    deadline = time.monotonic() + timeout_s
    try:
        await probe.start()
        unsettled: list[Any] = []
        while True:
            stable = await consumer.highwaters(*tps)
            ends = await probe.end_offsets([TopicPartition(tp.topic, tp.partition) for tp in tps])
            unsettled = [
                tp
                for tp in tps
                if (stable.get(tp) or 0) < ends.get(TopicPartition(tp.topic, tp.partition), 0)
            ]
            if not unsettled or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        if unsettled:
            log.warning(
                "changelog partitions still have open transactions after %.0f s, restoring "
                "what is committed: %s",
                timeout_s,
                ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(unsettled)),
            )
    except Exception as exc:  # the probe is a safeguard: recovery goes on without it
        log.warning("could not compare changelog end offsets before recovery: %s", exc)
    finally:
        await probe.stop()


class UnsentTableWrite(RuntimeError):
    """A table write buffered before a commit was not sent: the commit must not happen."""


async def buffered_records_sent(producer: Any, timeout_s: float) -> None:
    """Wait until the record buffered last in ``producer`` has been sent (see above)."""
    if producer.app.conf.producer_threaded:  # another queue: drain the whole buffer
        await producer.flush()
        return
    last = getattr(producer.buffer, "last_buffered", None)
    if last is None:
        return
    if last.cancelled():
        raise UnsentTableWrite("a buffered table write was cancelled; not committing")
    try:
        await asyncio.wait_for(asyncio.shield(last), timeout_s)
    except TimeoutError:
        raise UnsentTableWrite(
            f"a buffered table write was not sent within {timeout_s:.0f} s; not committing"
        ) from None
    except Exception as exc:
        raise UnsentTableWrite(f"a buffered table write failed; not committing: {exc}") from exc


def build_app(kafka: KafkaSettings, worker: WorkerSettings) -> faust.App:
    ns = kafka.namespace
    if worker.exactly_once:
        flush_before_transaction_commit()
        restore_only_settled_changelogs(kafka)
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
    folded: Counter[str] = Counter()  # input messages folded, by source (for /metrics)
    inputs = {HEARTBEATS.name(ns): "heartbeats", KV_EVENTS.name(ns): "kv_events"}
    inputs[LEDGER.name(ns)] = "ledger"

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
        folded["dead_lettered"] += 1
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
            folded["heartbeats"] += 1
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
            folded["kv_events"] += 1
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
            folded["ledger"] += 1
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

    @app.page("/metrics")
    async def metrics(view: Any, request: Any) -> Any:
        """The worker's figures for Prometheus: input folded by source, dead letters, what its
        tables hold, and how far its consumer is behind its inputs."""
        lines = []

        def family(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
            suffix = "_total" if kind == "counter" else ""
            lines.extend(f"{name}{suffix}{labels} {value}" for labels, value in samples)

        family(
            "kvgate_worker_folded",
            "counter",
            "Input messages folded into the tables, by source",
            [(f'{{source="{src}"}}', folded[src]) for src in ("heartbeats", "kv_events", "ledger")],
        )
        family(
            "kvgate_worker_dead_lettered",
            "counter",
            "Input messages sent to the dead-letter topic",
            [("", folded["dead_lettered"])],
        )
        family("kvgate_worker_nodes", "gauge", "Nodes in its load table", [("", len(beats))])
        family(
            "kvgate_worker_index_entries",
            "gauge",
            "(node, block) entries of its prefix index partitions",
            [("", sum(len(b) for b in mirror.values()))],
        )
        lag: Counter[str] = Counter()
        consumer: Any = app.consumer
        for tp in consumer.assignment():
            source = inputs.get(tp.topic)
            committed = consumer._committed_offset.get(tp)
            if source is None:
                continue
            with contextlib.suppress(Exception):
                lag[source] += max(0, consumer.highwater(tp) - (committed or 0))
        family(
            "kvgate_worker_consumer_lag",
            "gauge",
            "Input messages not yet committed, by source",
            [(f'{{source="{src}"}}', lag[src]) for src in ("heartbeats", "kv_events", "ledger")],
        )
        return view.web.text("\n".join(lines) + "\n", content_type="text/plain; version=0.0.4")

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
