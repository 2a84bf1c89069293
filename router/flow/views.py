"""The cluster as this router sees it: node views from the replicated load table, the fleet's
drains and start times, the feed's state and this router's own in-flight work; and what each
node holds of a prompt (the replicated prefix index with its offloaded tiers, plus what this
router had prefilled recently and, for nodes without KV events, what it sent them).

Views are cached per heartbeat: a node whose heartbeat did not change keeps its view object, and
only the router's in-flight state is laid over it per request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from router.decision.approx import ApproxIndex
from router.decision.fit import fit_floor_tokens
from router.decision.fleet import Fleet
from router.decision.inflight import InflightLedger
from router.decision.recent import RecentPrefills, known_matches, merge_matches
from router.decision.types import NodeView
from router.feed import FeedWatch
from router.settings import RouterSettings
from streams.blocks import offloaded
from streams.replica import TableReplica
from streams.schemas import Heartbeat

__all__ = ["ClusterView"]


class ClusterView:
    def __init__(
        self,
        settings: RouterSettings,
        replica: TableReplica,
        fleet: Fleet,
        feed: FeedWatch,
        ledger: InflightLedger,
    ) -> None:
        self.settings = settings
        self.replica = replica
        self.fleet = fleet
        self.feed = feed
        self.ledger = ledger
        self.recent = (
            RecentPrefills(settings.recent_prefill_ttl_s)
            if settings.recent_prefill_ttl_s > 0
            else None
        )
        self.approx = ApproxIndex()
        self.approx_nodes: set[str] = set()  # nodes without KV events (approximate index)
        self.adapter_base: dict[str, str] = {}  # LoRA adapter -> its base model (heartbeats)
        self.roles = False  # some node has the prefill or decode role
        # per node, the longest prompt that fits there now whatever its cache holds; their
        # minimum lets the fit filter (router/decision/fit.py) skip its pass for every shorter
        # prompt
        self._fit_floors: dict[str, int] = {}
        self.fit_floor = 0
        self._behind_since: dict[str, float] = {}
        self._views: dict[str, tuple[Heartbeat, NodeView]] = {}
        self._last_sweep = 0.0

    def nodes(self, now: float) -> list[NodeView]:
        if now - self._last_sweep > 30.0:
            self.ledger.sweep(now)
            self._last_sweep = now
            load = self.replica.load
            self._fit_floors = {k: v for k, v in self._fit_floors.items() if k in load}
        feed = self.feed.update(now)
        rx = self.replica.last_heartbeat_rx or now
        received = self.replica.received
        out = []
        cache = self._views
        approx = self.approx_nodes
        approx.clear()
        adapters: dict[str, str] = {}
        roles = False
        refloor = False
        for hb in self.replica.load.values():
            roles = roles or hb.role != "mixed"
            if hb.kv_index != "events":  # approximate, or events that do not arrive
                approx.add(hb.node_id)
            for name in hb.adapters:
                adapters.setdefault(name, hb.model)
            gap, age = self.index_lag(hb, now)
            cached = cache.get(hb.node_id)
            if cached is None or cached[0] is not hb:
                view = NodeView(
                    node_id=hb.node_id,
                    endpoint=hb.endpoint,
                    model=hb.model,
                    pool=hb.pool,
                    block_size=hb.block_size,
                    kv_blocks_total=hb.kv_blocks_total,
                    kv_blocks_used=hb.kv_blocks_used,
                    kv_blocks_admissible=hb.kv_blocks_admissible,
                    max_model_len=hb.max_model_len,
                    running=hb.running,
                    waiting=hb.waiting,
                    healthy=hb.healthy,
                    draining=hb.draining,
                    heartbeat_ts=received.get(hb.node_id, hb.ts),
                    lease_s=self.settings.stale_heartbeat_s or hb.lease_s,
                    adapters=frozenset(hb.adapters),
                    dp_rank=hb.data_parallel_rank,
                    started_at=self.fleet.started(hb.node_id, hb.epoch, hb.engine_started_at, now),
                    labels=frozenset(hb.labels.items()),
                    role=hb.role,
                    kv_link_gbps=hb.kv_link_gbps,
                    retention_hints=hb.retention_hints,
                    kv_pull=hb.kv_pull,
                )
                cache[hb.node_id] = (hb, view)
                self._fit_floors[hb.node_id] = fit_floor_tokens(view)
                refloor = True
            else:
                view = cached[1]
            if gap:
                view = replace(view, kv_index_gap=gap, kv_index_age_s=age)
            if hb.node_id in self.fleet.drained:
                view = replace(view, draining=True)  # an operator drains it (kvgate drain)
            if feed != "live":
                if rx - view.heartbeat_ts > view.lease_s or hb.node_id in self.feed.down:
                    continue  # dead before the feed stopped, or does not answer now
                # alive as far as anyone can tell; load_only: only this router's own count
                view = replace(view, heartbeat_ts=now, kv_index_gap=0, kv_index_age_s=0.0)
                if feed == "load_only":
                    view = replace(view, running=0, waiting=0)
            out.append(
                self.ledger.view(view, hb.ts, now, view.model, hb.prefill_tokens_per_s or 0.0)
            )
        if adapters or self.adapter_base:  # a base model's name is never an adapter's
            bases = {hb.model for hb in self.replica.load.values()}
            self.adapter_base = {a: m for a, m in adapters.items() if a not in bases}
        self.roles = roles  # some node is a prefill or decode node (router/decision/disagg.py)
        if len(cache) > 2 * len(self.replica.load) + 16:  # retired nodes
            for node in set(cache) - set(self.replica.load):
                del cache[node]
                self.approx.forget(node)
            self.fleet.forget(self.replica.load)
        if refloor:
            self.fit_floor = min(self._fit_floors.values(), default=0)
        return out

    def index_lag(self, hb: Heartbeat, now: float) -> tuple[int, float]:
        """KV batches the node announced (heartbeat ``kv_seq``) that the index lacks, and since
        when the index has been behind (0 when it is not)."""
        gap = 0
        if hb.kv_seq is not None:
            cursor = self.replica.cursors.get(hb.node_id)
            if cursor is None or cursor.epoch != hb.epoch:
                gap = hb.kv_seq + 1
            else:
                gap = max(0, hb.kv_seq - cursor.seq)
        if gap <= 0:
            self._behind_since.pop(hb.node_id, None)
            return 0, 0.0
        since = self._behind_since.setdefault(hb.node_id, hb.ts)
        return gap, max(0.0, now - since)

    def matches(self, hashes: Sequence[int], now: float, exact: bool = True) -> dict[str, int]:
        """Per node, the prefix it holds: the index, plus what this router just had prefilled.
        ``exact`` False: the hashes are of approximate tokens (no tokenizer for the model),
        which the index — the engines' own tokens — matches only where an engine tokenizes the
        same way; the router's memory of what it had each node prefill counts on every node
        then, as on nodes without KV events (never worse with working events than without)."""
        gpu, tier = self.replica.index.match_tiers(hashes, offloaded)
        matches = gpu
        if tier:  # blocks in an offloaded tier after the GPU prefix: a cheaper miss
            value = self.settings.offload_hit_value
            matches = {
                n: gpu.get(n, 0) + int(value * tier.get(n, 0)) for n in gpu.keys() | tier.keys()
            }
        matches = known_matches(matches, hashes, now, self.recent, self.ledger.pending)
        # nodes without KV events, or approximate tokens: what this router had them prefill
        remembered = self.approx_nodes if exact else self.approx.nodes()
        if remembered:
            matches = merge_matches(matches, self.approx.match(hashes, remembered))
        return matches

    def prefilled(self, node: str, hashes: Sequence[int], exact: bool = True) -> None:
        """``node`` computed the prompt ``hashes`` (``exact``: of the engine's tokens): it
        caches them from now on."""
        if self.recent is not None:
            self.recent.add(node, hashes, time.time())
        if node in self.approx_nodes or not exact:
            hb = self.replica.load.get(node)
            self.approx.add(node, hashes, hb.kv_blocks_total if hb is not None else 0)
