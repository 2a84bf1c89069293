"""The Faust app: folds heartbeats, KV events and reservations into the tables.

Agents are thin: decode (invalid → dead-letter topic), call a pure fold from
:mod:`streams.folds`, keep the result in memory. The table writes wait for the next commit
(:class:`CoalescedTable`, :func:`write_tables_before_commit`): per commit interval one record per
changed node in the prefix index (a segment, :mod:`streams.segments`), the latest heartbeat per
node in the load table, the last state per reservation in the ledger. The cost of the tables is
per node and interval, not per block or message. Writes for one node go to its input partition;
with ``exactly_once`` Faust wraps each commit interval in a Kafka transaction, so the input
offsets and the records that fold them commit together.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, TypeVar

import faust

from streams.codec import decode, encode
from streams.exceptions import SchemaError
from streams.faustcommit import (
    allow_commit_bursts,
    commit_on_a_fixed_cadence,
    commit_transactions_together,
    flush_before_transaction_commit,
    write_tables_before_commit,
)
from streams.faustpatch import (
    FAUST_FETCH_WAIT_MS,
    commit_folded_offsets,
    dispatch_without_tasks,
    fold_input_inline,
    restore_only_settled_changelogs,
    set_fetch_wait,
)
from streams.folds import is_newer, plan_kv
from streams.kafka import KafkaBus
from streams.kafka import dead_letter as kafka_dead_letter
from streams.ledger import ledger_fold
from streams.ordered import OrderedInput
from streams.schemas import Heartbeat, KvEventBatch, LedgerEvent, Message
from streams.segments import BASE, NodeSegments, group_records, segment_key
from streams.settings import KafkaSettings, WorkerSettings
from streams.tables import KV_LEDGER, LOAD, PREFIX_INDEX, app_id
from streams.topics import DLQ, HEARTBEATS, KV_EVENTS, LEDGER
from streams.workermetrics import input_lag, render_metrics

__all__ = ["build_app"]

log = logging.getLogger(__name__)
RAW: dict[str, Any] = {"key_type": bytes, "value_type": bytes}
RAW_TOPIC: dict[str, Any] = {**RAW, "key_serializer": "raw", "value_serializer": "raw"}
M = TypeVar("M", bound=Message)
PRODUCER_BATCH_BYTES = 512 * 1024  # a commit's table records of one partition: a few batches
COMMIT_BURST = 100_000  # table records one commit may write before Faust holds the input up
# changelog segments roll every minute, so compaction keeps what a restarting reader folds close
# to the tables' size (one base and a few deltas per node) instead of a week of records
CHANGELOG_CONFIG = {"segment.ms": "60000", "min.cleanable.dirty.ratio": "0.25"}


class CoalescedTable:
    """A Faust table whose writes wait for the next commit, the last value per key.

    A key written ten times in one commit interval costs one changelog record; a key set and
    deleted in the same interval, none. Writes go to the changelog partition given (the input
    partition of the node or reservation, as Faust's own writes do) and to the table's
    in-memory store, which is what recovery restores and :meth:`items` reads. The changelog
    records are left in ``outbox``, which the commit sends in one batch per partition
    (:func:`streams.faustcommit.send_table_records`) before it commits."""

    def __init__(self, table: Any, outbox: list[tuple[str, int, bytes, bytes | None]]) -> None:
        self.table = table
        self.outbox = outbox
        self.pending: dict[bytes, tuple[int, bytes | None]] = {}

    def get(self, key: bytes) -> bytes | None:
        if key in self.pending:
            return self.pending[key][1]
        value: bytes | None = self.table.data.get(key)
        return value

    def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        self.pending[key] = (partition, value)

    def items(self) -> list[tuple[bytes, bytes]]:
        """What the table holds (written records; pending writes are not included)."""
        return list(self.table.data.items())

    def partition_of(self, key: bytes) -> int:
        """The changelog partition a restored key came from (-1: not known)."""
        parts = getattr(self.table.data, "_key_partition", {})
        return int(parts.get(key, -1))

    def write(self, owned: set[int]) -> int:
        """Send the pending writes of the partitions this worker's consumer holds (the
        partitions whose offsets a commit now carries) and apply them to the store; the others
        stay pending until the partition is back or :meth:`drop` discards them."""
        store = self.table.data
        data = store.data
        topic = self.table.changelog_topic.get_topic_name()
        parts = getattr(store, "_key_partition", None)
        sent = 0
        kept: dict[bytes, tuple[int, bytes | None]] = {}
        for key, (partition, value) in self.pending.items():
            if partition not in owned:
                kept[key] = (partition, value)
                continue
            if value is None:
                if key not in data:  # never written: nothing to delete
                    continue
                del data[key]
                if parts is not None:
                    parts.pop(key, None)
            else:
                data[key] = value
                if parts is not None:
                    parts[key] = partition
            self.outbox.append((topic, partition, key, value))
            sent += 1
        self.pending = kept
        return sent

    def rewrite(self, owned: set[int]) -> None:
        """Write again, at the next commit, every entry the store holds for ``owned``
        partitions (pending writes win)."""
        for key, value in self.table.data.items():
            partition = self.partition_of(key)
            if partition in owned and key not in self.pending:
                self.pending[key] = (partition, value)

    def drop(self, owned: set[int]) -> None:
        """Forget pending writes of partitions this worker lost in a rebalance (their new owner
        folds that input again from the committed offsets)."""
        self.pending = {k: v for k, v in self.pending.items() if v[0] in owned}


def build_app(kafka: KafkaSettings, worker: WorkerSettings) -> faust.App:
    ns = kafka.namespace
    write_tables_before_commit()
    commit_folded_offsets()
    dispatch_without_tasks()
    fold_input_inline()
    allow_commit_bursts(COMMIT_BURST)
    commit_on_a_fixed_cadence()
    if worker.exactly_once:
        flush_before_transaction_commit()
        commit_transactions_together()
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
        producer_max_batch_size=PRODUCER_BATCH_BYTES,
        table_standby_replicas=0,
        datadir=worker.data_dir,
        key_serializer="raw",
        value_serializer="raw",
    )
    heartbeats = app.topic(HEARTBEATS.name(ns), **RAW_TOPIC)
    kv_events = app.topic(KV_EVENTS.name(ns), **RAW_TOPIC)
    ledger_topic = app.topic(LEDGER.name(ns), **RAW_TOPIC)
    dlq = app.topic(DLQ.name(ns), **RAW_TOPIC)

    outbox: list[tuple[str, int, bytes, bytes | None]] = []  # sent by the commit (faustcommit)
    app.table_outbox = outbox  # type: ignore[attr-defined]

    def table(name: str) -> CoalescedTable:
        return CoalescedTable(
            app.Table(
                name,
                default=None,
                partitions=kafka.partitions,
                extra_topic_configs=CHANGELOG_CONFIG,
                **RAW,
            ),
            outbox,
        )

    load, index, ledger = table(LOAD.name), table(PREFIX_INDEX.name), table(KV_LEDGER.name)

    # What the worker holds for the partitions it owns: each node's blocks and segment writer,
    # each node's last heartbeat (epoch, seq, ts, partition). Rebuilt after every rebalance for
    # the partitions it was newly given; kept (with its unwritten changes) for the ones it kept.
    nodes: dict[str, NodeSegments] = {}
    beats: dict[str, tuple[str, int, float, int]] = {}
    dirty: set[str] = set()  # nodes with changes not yet written
    mirror_ok = False
    folded: Counter[str] = Counter()  # input messages folded, by source (for /metrics)
    written: Counter[str] = Counter()  # table records written, by table (for /metrics)
    inputs = {HEARTBEATS.name(ns): "heartbeats", KV_EVENTS.name(ns): "kv_events"}
    inputs[LEDGER.name(ns)] = "ledger"
    # each table is written to the partitions of the input that feeds it
    feeds = {index: KV_EVENTS.name(ns), load: HEARTBEATS.name(ns), ledger: LEDGER.name(ns)}
    ordered = OrderedInput(app, kafka, worker.exactly_once, set(inputs), folded)

    def owned(topic: str) -> set[int]:
        """The partitions of input ``topic`` the consumer holds: the ones a commit carries
        offsets of (Faust filters each commit by this assignment). Other topics' partitions
        (changelogs, Faust's assignor topic) say nothing about which tables this worker owns."""
        consumer: Any = app.consumer
        return {tp.partition for tp in consumer.assignment() if tp.topic == topic}

    @app.on_rebalance_complete.connect
    def _invalidate(*_: Any, **__: Any) -> None:
        nonlocal mirror_ok
        mirror_ok = False
        ordered.reset()

    @app.on_partitions_revoked.connect
    def _recovery_fetches(*_: Any, **__: Any) -> None:
        set_fetch_wait(app, FAUST_FETCH_WAIT_MS)  # Faust's own, while it recovers tables

    @app.timer(interval=ordered.frontier.retry_s)  # type: ignore[untyped-decorator]
    async def reread_quiet_partitions() -> None:
        await ordered.reread_quiet()

    def rebuild() -> None:
        nonlocal mirror_ok
        if mirror_ok:
            return
        # folding input again: recovery is over (faustpatch.set_fetch_wait)
        set_fetch_wait(app, kafka.follow_fetch_wait_ms)
        mine = {table: owned(topic) for table, topic in feeds.items()}
        for gone in [n for n, seg in nodes.items() if seg.partition not in mine[index]]:
            del nodes[gone]
            dirty.discard(gone)
        for gone in [n for n, beat in beats.items() if beat[3] not in mine[load]]:
            del beats[gone]
        for table in (index, load, ledger):
            table.drop(mine[table])
        # what this worker kept is written again at the next commit (a new base per node, the
        # latest heartbeat, the open reservations): writes still in a transaction a rebalance
        # ended without committing are then replaced, and the tables converge whatever Faust
        # did with that transaction
        for node, seg in nodes.items():
            seg.rebase = seg.dirty = True
            dirty.add(node)
        load.rewrite(mine[load])
        ledger.rewrite(mine[ledger])
        for node, records in group_records(index.items()).items():
            if node not in nodes:
                part = index.partition_of(segment_key(node, BASE, 0))
                nodes[node] = NodeSegments.restored(part, records)
        for key, value in load.items():
            node = key.decode()
            if node not in beats:
                hb = Heartbeat.model_validate_json(value)
                beats[node] = (hb.epoch, hb.seq, hb.ts, load.partition_of(key))
        mirror_ok = True

    def write_tables() -> None:
        """Write what changed since the last commit: one segment record per changed node, its
        latest heartbeat, the open reservations' last state (called before every commit)."""
        mine = {table: owned(topic) for table, topic in feeds.items()}
        for node in list(dirty):
            seg = nodes.get(node)
            if seg is None or seg.partition not in mine[index]:
                continue
            for key, value in seg.flush(node):
                index.put(seg.partition, key, value)
            dirty.discard(node)
        for name, table in (("prefix_index", index), ("load", load), ("kv_ledger", ledger)):
            written[name] += table.write(mine[table])

    app.before_commit = write_tables  # type: ignore[attr-defined]
    commit_seconds: dict[str, list[float]] = {}  # phase -> [sum, count, last] (faustcommit)
    app.commit_seconds = commit_seconds  # type: ignore[attr-defined]

    async def dead_letter(msg: Any, error: str, consumer: str) -> None:
        folded["dead_lettered"] += 1
        log.warning("dead-lettering %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, error)
        letter = kafka_dead_letter(msg, error, consumer)
        await dlq.send(key=msg.topic.encode(), value=encode(letter))

    def forget(node: str, partition: int) -> None:
        """A node retired (tombstone on the input): drop its entries from every table."""
        rebuild()
        seg = nodes.pop(node, None)
        dirty.discard(node)
        records = (seg or NodeSegments(partition)).tombstones(node)
        for key, value in records:
            index.put(partition, key, value)
        if beats.pop(node, None) is not None:
            load.put(partition, node.encode(), None)

    async def node_message(msg: Any, model: type[M], consumer: str) -> M | None:
        """The record's message, or None when it was a retirement (handled here) or invalid
        (dead-lettered)."""
        if not await ordered.admit(msg):
            return None
        key = msg.key.decode("utf-8", "replace") if isinstance(msg.key, bytes) else None
        if msg.value is None and key is not None:
            forget(key, msg.partition)
            return None
        try:
            decoded = decode(model, msg.value)
        except SchemaError as exc:
            await dead_letter(msg, str(exc), consumer)
            return None
        if key != getattr(decoded, "node_id", None):
            await dead_letter(msg, "the message key must be the node id", consumer)
            return None
        rebuild()
        return decoded

    async def fold_heartbeat(msg: Any) -> None:
        hb = await node_message(msg, Heartbeat, "worker.load")
        if hb is None:
            return
        folded["heartbeats"] += 1
        prev = beats.get(hb.node_id)
        if is_newer(None if prev is None else prev[:2], (hb.epoch, hb.seq)):
            # what was validated, not the bytes received: fields this version does not know
            # (a newer agent's, or anyone's junk) never reach the table
            load.put(msg.partition, hb.node_id.encode(), encode(hb))
            beats[hb.node_id] = (hb.epoch, hb.seq, hb.ts, msg.partition)

    async def fold_kv_batch(msg: Any) -> None:
        batch = await node_message(msg, KvEventBatch, "worker.prefix_index")
        if batch is None:
            return
        folded["kv_events"] += 1
        node = batch.node_id
        seg = nodes.get(node)
        if seg is None:
            seg = nodes[node] = NodeSegments(msg.partition)
        seg.partition = msg.partition
        plan = plan_kv(seg.cursor, seg.blocks, batch)
        if not plan.apply:
            return
        if plan.gap:
            log.warning("KV batches of %s were lost before %s/%d", node, batch.epoch, batch.seq)
        seg.apply(plan, replaced=batch.kind == "snapshot" or batch.cleared)
        dirty.add(node)

    async def fold_ledger_event(msg: Any) -> None:
        """One entry per open reservation: set on reserve, its lease moved on renew, deleted on
        release or expire (all idempotent, so a replay folds to the same table)."""
        if not await ordered.admit(msg):
            return
        try:
            ev = decode(LedgerEvent, msg.value)
        except SchemaError as exc:
            await dead_letter(msg, str(exc), "worker.kv_ledger")
            return
        folded["ledger"] += 1
        key = ev.reservation_id.encode()
        if ev.kind == "reserve":
            ledger.put(msg.partition, key, encode(ev))
            return
        held = ledger.get(key)
        if held is None:  # closed already (or never opened): nothing to change
            return
        entry = ledger_fold(ev, LedgerEvent.model_validate_json(held))
        if entry is None:
            ledger.put(msg.partition, key, None)
        else:  # a renew: the open entry with its new lease
            ledger.put(msg.partition, key, encode(entry))

    # the consumer hands each input record straight to its fold (fold_input_inline); the agents
    # subscribe the topics and fold whatever Faust still delivers through a stream
    folds = {
        HEARTBEATS.name(ns): fold_heartbeat,
        KV_EVENTS.name(ns): fold_kv_batch,
        LEDGER.name(ns): fold_ledger_event,
    }
    app.inline_folds = folds  # type: ignore[attr-defined]

    def subscribe(topic: Any) -> None:
        fold = folds[topic.get_topic_name()]

        async def drain(stream: faust.StreamT[bytes]) -> None:
            async for event in stream.events():
                await fold(event.message)

        app.agent(topic, name=f"fold-{topic.get_topic_name()}")(drain)

    for topic in (heartbeats, kv_events, ledger_topic):
        subscribe(topic)

    @app.page("/metrics")
    async def metrics(view: Any, request: Any) -> Any:
        """The worker's figures for Prometheus (:mod:`streams.workermetrics`)."""
        entries = sum(len(seg.blocks) for seg in nodes.values())
        lag = input_lag(app.consumer, inputs)
        text = render_metrics(folded, written, len(beats), entries, commit_seconds, lag)
        return view.web.text(text, content_type="text/plain; version=0.0.4")

    reaper: KafkaBus | None = None

    @app.timer(interval=worker.reap_interval_s)  # type: ignore[untyped-decorator]
    async def reap() -> None:
        """Retire nodes silent for ``node_ttl_s``: a tombstone on both input topics, which the
        agents above (and every router) fold like any other event."""
        nonlocal reaper
        if not mirror_ok:
            return
        now = time.time()
        dead = [n for n, (_, _, ts, _) in beats.items() if now - ts > worker.node_ttl_s]
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

    @app.on_before_shutdown.connect
    async def _stop_clients(*_: Any, **__: Any) -> None:
        """Stop the worker's own Kafka clients (the offset probe, the reaper) with the app."""
        await ordered.stop()
        if reaper is not None:
            with contextlib.suppress(Exception):
                await reaper.stop()

    return app
