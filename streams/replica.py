"""A router's in-memory replica of the load table and the prefix index: bootstrapped from the
worker's tables, then following its input (the three phases and their exactness are in
:mod:`streams.tablesinput`). A router killed at any time rebuilds the same state on restart;
``follow_input=False`` keeps following the changelogs instead, so the replica shows exactly what
the tables hold (tests and operators use it to check the worker).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from streams.exceptions import SchemaError
from streams.folds import KvCursor, heartbeat_is_newer, plan_kv
from streams.prefix_index import PrefixIndex
from streams.schemas import Heartbeat, KvEventBatch
from streams.segments import (
    BASE,
    Segment,
    SegmentState,
    fold_segment,
    group_records,
    parse_segment_key,
    restore_node,
)
from streams.settings import KafkaSettings, WorkerSettings
from streams.tables import LOAD, PREFIX_INDEX, app_id
from streams.tablesinput import TablesThenInput
from streams.topics import HEARTBEATS, KV_EVENTS

__all__ = ["TableReplica", "TablesThenInput"]  # (the base: streams.tablesinput)

log = logging.getLogger(__name__)


class TableReplica(TablesThenInput):
    def __init__(
        self,
        kafka: KafkaSettings,
        worker: WorkerSettings,
        client_id: str,
        *,
        follow_input: bool = True,
        node_ttl_s: float = 60.0,
        feed_stale_s: float = 1.5,
    ) -> None:
        group = app_id(kafka, worker)
        self.load_topic = LOAD.changelog(group)
        self.index_topic = PREFIX_INDEX.changelog(group)
        self.hb_topic = HEARTBEATS.name(kafka.namespace)
        self.kv_topic = KV_EVENTS.name(kafka.namespace)
        super().__init__(
            kafka,
            worker,
            client_id,
            (self.load_topic, self.index_topic),
            (self.hb_topic, self.kv_topic),
            follow_input=follow_input,
        )
        self.node_ttl_s = node_ttl_s
        self.feed_stale_s = feed_stale_s
        # node -> when this replica received its newest heartbeat (its own clock: an agent's
        # wall clock says nothing about liveness); bootstrap records count at their own time
        self.received: dict[str, float] = {}
        self.last_heartbeat_rx: float | None = None  # newest heartbeat received live
        self.index = PrefixIndex()
        self.load: dict[str, Heartbeat] = {}
        self.cursors: dict[str, KvCursor] = {}
        self.segments: dict[str, SegmentState] = {}  # per node, while reading the changelog
        self.index_updated_s: dict[str, float] = {}  # node -> when its entries last changed here
        self.gaps = 0
        self.on_load: Callable[[Heartbeat, float], None] | None = None
        self.on_block: Callable[[str, int, float], None] | None = None
        # while bootstrapping: the last record per (changelog, key), what compaction would keep
        self.latest: dict[tuple[str, bytes], bytes | None] = {}

    def _reset(self) -> None:
        self.index, self.load, self.cursors = PrefixIndex(), {}, {}
        self.received, self.segments, self.latest = {}, {}, {}

    def _describe(self) -> str:
        return f"{len(self.load)} nodes, {len(self.index)} blocks"

    def _tick(self, now: float) -> None:
        self.expire(now)

    # --- folds (the worker's, applied here) ------------------------------------------------
    def _apply_changelog(
        self, topic: str, key: bytes | None, value: bytes | None, now: float
    ) -> None:
        if key is None:
            return
        self.records += 1
        if topic == self.index_topic:
            self._apply_segment(key, value, now)
        else:
            self._apply_load(topic, key, value, now)

    def _bootstrap_apply(self) -> Callable[[str, bytes | None, bytes | None, float], None]:
        return self._keep_latest

    def _keep_latest(self, topic: str, key: bytes | None, value: bytes | None, _: float) -> None:
        """Bootstrap: keep the last record per key; :meth:`_bootstrap_done` folds them. A
        changelog not yet compacted holds many records per key (a node's base and deltas are
        rewritten every few commit intervals); only the last one says what the table holds."""
        if key is not None:
            self.records += 1
            self.latest[(topic, key)] = value

    def _bootstrap_done(self, now: float) -> None:
        """Fold the tables as their last records per key say: the load table's heartbeats, and
        each node's segments restored as the worker restores them (its base, then its
        generation's deltas by slot; :func:`streams.segments.restore_node`)."""
        latest, self.latest = self.latest, {}
        segments: list[tuple[bytes, bytes]] = []
        for (topic, key), value in latest.items():
            if topic != self.index_topic:
                self.apply_record(self._apply_load, topic, key, value, now)
            elif value is not None:  # (a deleted key: a retired node, a smaller base)
                segments.append((key, value))
        for node, records in group_records(segments, self._bad_segment).items():
            blocks, state, _ = restore_node(records)
            if state.cursor is None:  # no base (deltas of a node whose base was deleted)
                continue
            self.index.add_many(node, blocks)
            if self.on_block is not None:
                for block in blocks:
                    self.on_block(node, block, now)
            self.cursors[node] = state.cursor
            self.segments[node] = state
            self.index_updated_s[node] = now

    def _bad_segment(self, key: bytes, exc: ValueError) -> None:
        self.bad_records += 1
        log.warning("%s skipped a %s record: %s", self.client_id, self.index_topic, exc)

    def _apply_load(self, topic: str, key: bytes | None, value: bytes | None, now: float) -> None:
        if key is None:
            return
        node = key.decode()
        if value is None:
            self.load.pop(node, None)
            return
        with contextlib.suppress(SchemaError, ValueError):
            self._set_load(Heartbeat.model_validate_json(value), now, live=False)

    def _apply_segment(self, key: bytes, value: bytes | None, now: float) -> None:
        node, kind, index = parse_segment_key(key)
        if value is None:  # the node retired (its base is deleted), or an unused key is cleared
            if kind == BASE and index == 0:
                self.index.drop_node(node)
                self.cursors.pop(node, None)
                self.segments.pop(node, None)
                self.index_updated_s[node] = now
            return
        seg = Segment.decode(value)
        state = self.segments.setdefault(node, SegmentState())
        changes = fold_segment(state, self.index.blocks_view(node), seg)
        if changes is None:
            return
        upserts, deletes = changes
        for block in deletes:
            self.index.remove(node, block)
        for block in upserts:
            self.index.add(node, block)
            if self.on_block is not None:
                self.on_block(node, block, now)
        if state.cursor is not None:
            self.cursors[node] = state.cursor
        self.index_updated_s[node] = now

    def _apply_input(self, topic: str, key: bytes | None, value: bytes | None, now: float) -> None:
        if value is None:  # the worker retired the node
            if key is not None:
                self.forget(key.decode())
            return
        self.records += 1
        try:
            if topic == self.hb_topic:
                hb = Heartbeat.model_validate_json(value)
                self.last_heartbeat_rx = now  # the feed is alive, whatever the heartbeat says
                if heartbeat_is_newer(self.load.get(hb.node_id), hb):
                    self._set_load(hb, now, live=True)
            else:
                self.apply_kv(KvEventBatch.model_validate_json(value), now)
        except ValueError:  # invalid input: the worker dead-letters it
            return

    def _set_load(self, hb: Heartbeat, now: float, live: bool) -> None:
        self.load[hb.node_id] = hb
        self.received[hb.node_id] = now if live else min(hb.ts, now)
        if self.on_load is not None:
            self.on_load(hb, now)

    def apply_kv(self, batch: KvEventBatch, now: float) -> None:
        node = batch.node_id
        current = self.index.blocks_view(node)
        plan = plan_kv(self.cursors.get(node), current, batch)
        if not plan.apply:
            return
        if plan.gap:
            self.gaps += 1
        for block in plan.deletes:
            self.index.remove(node, block)
        for block in plan.upserts:
            self.index.add(node, block)
            if self.on_block is not None:
                self.on_block(node, block, now)
        self.cursors[node] = plan.cursor
        self.index_updated_s[node] = now

    def forget(self, node: str) -> None:
        self.load.pop(node, None)
        self.received.pop(node, None)
        self.index.drop_node(node)
        self.cursors.pop(node, None)
        self.segments.pop(node, None)
        self.index_updated_s.pop(node, None)

    def expire(self, now: float) -> list[str]:
        """Forget nodes not heard from for ``node_ttl_s``: their load and index entries. Not
        while the feed itself is silent (no heartbeat from any node for ``feed_stale_s``): then
        Kafka is away, not the nodes, and the last-known view is all a router has."""
        if self.last_heartbeat_rx is None or now - self.last_heartbeat_rx > self.feed_stale_s:
            return []
        dead = [
            n for n in self.load if now - self.received.get(n, self.load[n].ts) > self.node_ttl_s
        ]
        for node in dead:
            self.forget(node)
        return dead
