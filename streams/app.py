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

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import faust

from streams.coalesced import CoalescedTable
from streams.codec import decode, encode
from streams.exceptions import SchemaError
from streams.faustapp import faust_app
from streams.faustpatch import FAUST_FETCH_WAIT_MS, set_fetch_wait
from streams.folds import is_newer, plan_kv
from streams.kafka import KafkaBus, OffsetProbe
from streams.kafka import dead_letter as kafka_dead_letter
from streams.ledger import ledger_fold
from streams.ordered import OrderedInput
from streams.recoverywatch import RecoveryWatch, reread_lost_changelogs
from streams.schemas import Heartbeat, KvEventBatch, LedgerEvent, Message
from streams.segments import BASE, NodeSegments, group_records, segment_key
from streams.settings import KafkaSettings, WorkerSettings
from streams.tables import KV_LEDGER, LOAD, PREFIX_INDEX
from streams.topics import DLQ, HEARTBEATS, KV_EVENTS, LEDGER
from streams.workermetrics import input_lag, render_metrics

__all__ = ["WorkerTables", "build_app"]

log = logging.getLogger(__name__)
RAW: dict[str, Any] = {"key_type": bytes, "value_type": bytes}
RAW_TOPIC: dict[str, Any] = {**RAW, "key_serializer": "raw", "value_serializer": "raw"}
M = TypeVar("M", bound=Message)
# changelog segments roll every minute, so compaction keeps what a restarting reader folds close
# to the tables' size (one base and a few deltas per node) instead of a week of records
CHANGELOG_CONFIG = {"segment.ms": "60000", "min.cleanable.dirty.ratio": "0.25"}


class WorkerTables:
    """What a worker holds and does for the input partitions it owns.

    State: each node's blocks and segment writer, each node's last heartbeat (epoch, seq, ts,
    partition), the nodes with changes not yet written. Rebuilt after every rebalance for the
    partitions it was newly given (:meth:`rebuild`); kept, with its unwritten changes, for the
    ones it kept. The folds (:meth:`fold_heartbeat`, :meth:`fold_kv_batch`,
    :meth:`fold_ledger_event`) change it; :meth:`write_tables` writes what changed before every
    commit; :meth:`reap` retires silent nodes."""

    def __init__(self, app: Any, kafka: KafkaSettings, worker: WorkerSettings, dlq: Any) -> None:
        ns = kafka.namespace
        self.app, self.kafka, self.worker, self.dlq = app, kafka, worker, dlq
        self.outbox: list[tuple[str, int, bytes, bytes | None]] = []  # sent by the commit
        self.load = self._table(LOAD.name)
        self.index = self._table(PREFIX_INDEX.name)
        self.ledger = self._table(KV_LEDGER.name)
        self.nodes: dict[str, NodeSegments] = {}
        self.beats: dict[str, tuple[str, int, float, int]] = {}
        self.dirty: set[str] = set()  # nodes with changes not yet written
        self.mirror_ok = False
        self.folded: Counter[str] = Counter()  # input messages folded, by source (/metrics)
        self.written: Counter[str] = Counter()  # table records written, by table (/metrics)
        self.inputs = {
            HEARTBEATS.name(ns): "heartbeats",
            KV_EVENTS.name(ns): "kv_events",
            LEDGER.name(ns): "ledger",
        }
        # each table is written to the partitions of the input that feeds it
        self.feeds = {
            self.index: KV_EVENTS.name(ns),
            self.load: HEARTBEATS.name(ns),
            self.ledger: LEDGER.name(ns),
        }
        self.ordered = OrderedInput(app, kafka, worker.exactly_once, set(self.inputs), self.folded)
        self.recovery = RecoveryWatch[Any]()
        self.recovery_probe = OffsetProbe(
            kafka, f"{app.conf.id}-recovery-probe", worker.exactly_once
        )
        self.recovery_task: asyncio.Task[None] | None = None
        self.commit_seconds: dict[str, list[float]] = {}  # phase -> [sum, count, last]
        self.reaper: KafkaBus | None = None

    def _table(self, name: str) -> CoalescedTable:
        t = self.app.Table(
            name,
            default=None,
            partitions=self.kafka.partitions,
            extra_topic_configs=CHANGELOG_CONFIG,
            **RAW,
        )
        return CoalescedTable(t, self.outbox)

    def owned(self, topic: str) -> set[int]:
        """The partitions of input ``topic`` the consumer holds: the ones a commit carries
        offsets of (Faust filters each commit by this assignment). Other topics' partitions
        (changelogs, Faust's assignor topic) say nothing about which tables this worker owns."""
        consumer: Any = self.app.consumer
        return {tp.partition for tp in consumer.assignment() if tp.topic == topic}

    def invalidate(self, *_: Any, **__: Any) -> None:
        """A rebalance completed: rebuild before the next fold."""
        self.mirror_ok = False
        self.ordered.reset()

    def rebuild(self) -> None:
        if self.mirror_ok:
            return
        # folding input again: recovery is over (faustpatch.set_fetch_wait)
        set_fetch_wait(self.app, self.kafka.follow_fetch_wait_ms)
        index, load, ledger, nodes = self.index, self.load, self.ledger, self.nodes
        mine = {table: self.owned(topic) for table, topic in self.feeds.items()}
        for gone in [n for n, seg in nodes.items() if seg.partition not in mine[index]]:
            del nodes[gone]
            self.dirty.discard(gone)
        for gone in [n for n, beat in self.beats.items() if beat[3] not in mine[load]]:
            del self.beats[gone]
        for table in (index, load, ledger):
            table.drop(mine[table])
        # what this worker kept is written again at the next commit (a new base per node, the
        # latest heartbeat, the open reservations): writes still in a transaction a rebalance
        # ended without committing are then replaced, and the tables converge whatever Faust
        # did with that transaction
        for node, seg in nodes.items():
            seg.rebase = seg.dirty = True
            self.dirty.add(node)
        load.rewrite(mine[load])
        ledger.rewrite(mine[ledger])
        for node, records in group_records(index.items()).items():
            if node not in nodes:
                part = index.partition_of(segment_key(node, BASE, 0))
                nodes[node] = NodeSegments.restored(part, records)
        for key, value in load.items():
            node = key.decode()
            if node not in self.beats:
                hb = Heartbeat.model_validate_json(value)
                self.beats[node] = (hb.epoch, hb.seq, hb.ts, load.partition_of(key))
        self.mirror_ok = True

    def write_tables(self) -> None:
        """Write what changed since the last commit: one segment record per changed node, its
        latest heartbeat, the open reservations' last state (called before every commit)."""
        index = self.index
        mine = {table: self.owned(topic) for table, topic in self.feeds.items()}
        for node in list(self.dirty):
            seg = self.nodes.get(node)
            if seg is None or seg.partition not in mine[index]:
                continue
            for key, value in seg.flush(node):
                index.put(seg.partition, key, value)
            self.dirty.discard(node)
        for name, table in (
            ("prefix_index", index),
            ("load", self.load),
            ("kv_ledger", self.ledger),
        ):
            self.written[name] += table.write(mine[table])

    async def dead_letter(self, msg: Any, error: str, consumer: str) -> None:
        self.folded["dead_lettered"] += 1
        log.warning("dead-lettering %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, error)
        letter = kafka_dead_letter(msg, error, consumer)
        await self.dlq.send(key=msg.topic.encode(), value=encode(letter))

    def forget(self, node: str, partition: int) -> None:
        """A node retired (tombstone on the input): drop its entries from every table."""
        self.rebuild()
        seg = self.nodes.pop(node, None)
        self.dirty.discard(node)
        for key, value in (seg or NodeSegments(partition)).tombstones(node):
            self.index.put(partition, key, value)
        if self.beats.pop(node, None) is not None:
            self.load.put(partition, node.encode(), None)

    async def node_message(self, msg: Any, model: type[M], consumer: str) -> M | None:
        """The record's message, or None when it was a retirement (handled here) or invalid
        (dead-lettered)."""
        if not await self.ordered.admit(msg):
            return None
        key = msg.key.decode("utf-8", "replace") if isinstance(msg.key, bytes) else None
        if msg.value is None and key is not None:
            self.forget(key, msg.partition)
            return None
        try:
            decoded = decode(model, msg.value)
        except SchemaError as exc:
            await self.dead_letter(msg, str(exc), consumer)
            return None
        if key != getattr(decoded, "node_id", None):
            await self.dead_letter(msg, "the message key must be the node id", consumer)
            return None
        self.rebuild()
        return decoded

    async def fold_heartbeat(self, msg: Any) -> None:
        hb = await self.node_message(msg, Heartbeat, "worker.load")
        if hb is None:
            return
        self.folded["heartbeats"] += 1
        prev = self.beats.get(hb.node_id)
        if is_newer(None if prev is None else prev[:2], (hb.epoch, hb.seq)):
            # what was validated, not the bytes received: fields this version does not know
            # (a newer agent's, or anyone's junk) never reach the table
            self.load.put(msg.partition, hb.node_id.encode(), encode(hb))
            self.beats[hb.node_id] = (hb.epoch, hb.seq, hb.ts, msg.partition)

    async def fold_kv_batch(self, msg: Any) -> None:
        batch = await self.node_message(msg, KvEventBatch, "worker.prefix_index")
        if batch is None:
            return
        self.folded["kv_events"] += 1
        node = batch.node_id
        seg = self.nodes.get(node)
        if seg is None:
            seg = self.nodes[node] = NodeSegments(msg.partition)
        seg.partition = msg.partition
        plan = plan_kv(seg.cursor, seg.blocks, batch)
        if not plan.apply:
            return
        if plan.gap:
            log.warning("KV batches of %s were lost before %s/%d", node, batch.epoch, batch.seq)
        seg.apply(plan, replaced=batch.kind == "snapshot" or batch.cleared)
        self.dirty.add(node)

    async def fold_ledger_event(self, msg: Any) -> None:
        """One entry per open reservation: set on reserve, its lease moved on renew, deleted on
        release or expire (all idempotent, so a replay folds to the same table)."""
        if not await self.ordered.admit(msg):
            return
        try:
            ev = decode(LedgerEvent, msg.value)
        except SchemaError as exc:
            await self.dead_letter(msg, str(exc), "worker.kv_ledger")
            return
        self.folded["ledger"] += 1
        key = ev.reservation_id.encode()
        if ev.kind == "reserve":
            self.ledger.put(msg.partition, key, encode(ev))
            return
        held = self.ledger.get(key)
        if held is None:  # closed already (or never opened): nothing to change
            return
        entry = ledger_fold(ev, LedgerEvent.model_validate_json(held))
        # deleted on release or expire; a renew: the open entry with its new lease
        self.ledger.put(msg.partition, key, None if entry is None else encode(entry))

    def metrics_text(self) -> str:
        """The worker's figures for Prometheus (:mod:`streams.workermetrics`)."""
        entries = sum(len(seg.blocks) for seg in self.nodes.values())
        lag = input_lag(self.app.consumer, self.inputs)
        return render_metrics(
            self.folded, self.written, len(self.beats), entries, self.commit_seconds, lag
        )

    async def reap(self) -> None:
        """Retire nodes silent for ``node_ttl_s``: a tombstone on both input topics, which the
        folds above (and every router) fold like any other event."""
        if not self.mirror_ok:
            return
        now = time.time()
        ttl = self.worker.node_ttl_s
        dead = [n for n, (_, _, ts, _) in self.beats.items() if now - ts > ttl]
        if not dead:
            return
        if self.reaper is None:
            self.reaper = KafkaBus(self.kafka, f"{self.app.conf.id}-reaper")
            await self.reaper.start()
        ns = self.kafka.namespace
        for node in dead:
            log.info("retiring node %s (silent for %.0f s)", node, now - self.beats[node][2])
            await self.reaper.publish_raw(HEARTBEATS.name(ns), node.encode(), None)
            await self.reaper.publish_raw(KV_EVENTS.name(ns), node.encode(), None)
        await self.reaper.flush()

    def watch_recovery(self, *_: Any, **__: Any) -> None:
        """From the first assignment on, read again every second the changelog partitions a
        table recovery waits for in vain (:mod:`streams.recoverywatch`). Not a Faust timer:
        those start only once the first recovery is over, and that one can stall too."""
        if self.recovery_task is None:
            self.recovery_task = asyncio.get_running_loop().create_task(self._watch_recovery())

    async def _watch_recovery(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await reread_lost_changelogs(self.app, self.recovery, self.recovery_probe, self.folded)

    async def stop(self, *_: Any, **__: Any) -> None:
        """Stop the worker's own Kafka clients (the offset probes, the reaper) with the app."""
        await self.ordered.stop()
        if self.recovery_task is not None:
            self.recovery_task.cancel()
        await self.recovery_probe.stop()
        if self.reaper is not None:
            with contextlib.suppress(Exception):
                await self.reaper.stop()


def build_app(kafka: KafkaSettings, worker: WorkerSettings) -> faust.App:
    """The worker's Faust app: its topics, tables and folds (:class:`WorkerTables`), the
    commit hooks, the timers and ``/metrics``."""
    ns = kafka.namespace
    app = faust_app(kafka, worker)
    topics = [app.topic(t.name(ns), **RAW_TOPIC) for t in (HEARTBEATS, KV_EVENTS, LEDGER)]
    w = WorkerTables(app, kafka, worker, app.topic(DLQ.name(ns), **RAW_TOPIC))
    # what the commit hooks (streams/faustcommit.py) read
    app.table_outbox = w.outbox  # type: ignore[attr-defined]
    app.before_commit = w.write_tables  # type: ignore[attr-defined]
    app.commit_seconds = w.commit_seconds  # type: ignore[attr-defined]
    app.on_rebalance_complete.connect(w.invalidate)
    app.on_partitions_assigned.connect(w.watch_recovery)
    app.on_before_shutdown.connect(w.stop)

    @app.on_partitions_revoked.connect
    def _recovery_fetches(*_: Any, **__: Any) -> None:
        set_fetch_wait(app, FAUST_FETCH_WAIT_MS)  # Faust's own, while it recovers tables

    app.timer(interval=w.ordered.frontier.retry_s, name="reread_quiet_partitions")(
        w.ordered.reread_quiet
    )
    app.timer(interval=worker.reap_interval_s, name="reap")(w.reap)

    # the consumer hands each input record straight to its fold (fold_input_inline); the agents
    # subscribe the topics and fold whatever Faust still delivers through a stream
    folds = dict(
        zip(
            (t.get_topic_name() for t in topics),
            (w.fold_heartbeat, w.fold_kv_batch, w.fold_ledger_event),
            strict=True,
        )
    )
    app.inline_folds = folds  # type: ignore[attr-defined]
    for topic in topics:
        _subscribe(app, topic, folds[topic.get_topic_name()])

    @app.page("/metrics")
    async def metrics(view: Any, request: Any) -> Any:
        text = w.metrics_text()
        return view.web.text(text, content_type="text/plain; version=0.0.4")

    return app


def _subscribe(app: faust.App, topic: Any, fold: Callable[[Any], Awaitable[None]]) -> None:
    async def drain(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            await fold(event.message)

    app.agent(topic, name=f"fold-{topic.get_topic_name()}")(drain)
