"""The node agent: a sidecar that publishes one engine's load and KV-cache state to Kafka.

Every ``heartbeat_interval_s`` it scrapes the engine's Prometheus metrics and publishes a
:class:`Heartbeat`; it subscribes to the engine's KV events (ZeroMQ, vLLM format), translates them
to kvgate block hashes and publishes net deltas every ``kv_flush_interval_s`` (or sooner when
``kv_flush_max_blocks`` are pending), with a full snapshot at start and every
``snapshot_interval_s``. Sequence numbers are per node and epoch (one epoch per agent start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import replace
from typing import Literal

import aiohttp

from agents.enginemetrics import EngineStats, parse_metrics
from agents.kvtranslate import KvHealth, KvTranslator, Restarts
from agents.prewarm import Prewarmer
from agents.probe import PrefillProbe
from agents.settings import AgentSettings
from agents.vllm_events import KvEventSubscriber
from streams.fit import admissible_blocks
from streams.kafka import KafkaBus
from streams.schemas import Heartbeat, KvEventBatch
from streams.topics import HEARTBEATS, KV_EVENTS

__all__ = ["NodeAgent", "new_epoch"]

log = logging.getLogger(__name__)


def new_epoch() -> str:
    """Sortable by start time, unique per incarnation."""
    return f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:8]}"


class NodeAgent:
    def __init__(self, settings: AgentSettings, bus: KafkaBus, block_size: int = 16) -> None:
        self.settings = settings
        self.bus = bus
        self.epoch = new_epoch()
        self.translator = KvTranslator(block_size)
        self.kv_health = KvHealth(settings.kv_silence_s)
        self._hb_seq = 0
        self._kv_seq = 0
        self.subscriber: KvEventSubscriber | None = None
        self.restarts = Restarts()
        self._server_blocks: int | None = None  # SGLang: KV capacity from its server info
        self._last_stats: EngineStats | None = None
        self._last_scrape_s = 0.0
        self._rates = (0.0, 0.0)
        self._flush_now = asyncio.Event()
        self._kv_lock = asyncio.Lock()
        self._warned_degraded = False
        self.adapters: list[str] = []  # LoRA adapters the engine serves
        self.max_model_len: int | None = None  # the engine's context limit (/v1/models)
        self.served_model: str | None = None  # its base model's name (/v1/models)
        self.model_source: str | None = None  # and what it serves it from (its root)
        self.scrape_failures = 0
        self.kv_index_state: Literal["events", "approximate", "degraded"] = "events"
        self.draining = False  # stopping: heartbeats say so (agent.drain_on_stop_s)
        rank = settings.data_parallel_rank
        # one data-parallel rank of an engine: its metrics samples, its requests pinned to it
        self._engine_label = str(rank) if rank is not None else None
        self._rank_header = {"X-data-parallel-rank": str(rank)} if rank is not None else {}
        key = settings.engine_api_key
        self._auth = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        self._models_read_s = -float("inf")
        engine_headers = {**self._rank_header, **self._auth}
        self.prewarmer = Prewarmer(settings, bus, engine_headers)
        self.probe = PrefillProbe(
            settings.engine_url, engine_headers, settings.prefill_probe_tokens
        )

    @property
    def prewarmed(self) -> int:
        """Pre-warm advice the engine carried out."""
        return self.prewarmer.prewarmed

    async def run(self) -> None:
        """Run until cancelled."""
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            # learn the block size and start from a full (possibly empty) snapshot
            stats = await self._scrape(http)
            if stats is not None:
                self.translator.block_size = stats.block_size
                await self._read_adapters(http)
                await self._probe(http)  # before the first heartbeat: no router sends work yet
            tasks = [
                asyncio.create_task(self._heartbeats(http)),
                asyncio.create_task(self._flusher()),
                asyncio.create_task(self._probing(http)),
            ]
            if self.settings.kv_events_endpoint:
                tasks.append(asyncio.create_task(self._subscribe(self.settings.kv_events_endpoint)))
            if self.settings.prewarm:
                tasks.append(asyncio.create_task(self.prewarmer.run(http)))
            await self._publish_kv(snapshot=True)
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                for t in tasks:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t

    # --- heartbeats ----------------------------------------------------------------------
    async def _scrape(self, http: aiohttp.ClientSession) -> EngineStats | None:
        try:
            async with http.get(self.settings.engine_url.rstrip("/") + "/metrics") as resp:
                resp.raise_for_status()
                stats = parse_metrics(await resp.text(), self._engine_label)
            if stats.kind == "sglang" and not stats.num_gpu_blocks:
                # older SGLang has no max_total_num_tokens gauge: its server info has it
                stats = replace(stats, num_gpu_blocks=await self._sglang_blocks(http, stats))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("scrape of %s failed: %s", self.settings.engine_url, exc)
            self.scrape_failures += 1
            return None
        now = time.time()
        prev = self._last_stats
        if prev is not None and now > self._last_scrape_s:
            dt = now - self._last_scrape_s
            self._rates = (
                max(0.0, stats.prompt_tokens_total - prev.prompt_tokens_total) / dt,
                max(0.0, stats.generation_tokens_total - prev.generation_tokens_total) / dt,
            )
        restarted = prev is not None and (
            (
                stats.start_time_s is not None
                and prev.start_time_s is not None
                and stats.start_time_s != prev.start_time_s
            )
            # without process_start_time_seconds (custom registries): a counter going back
            or stats.prompt_tokens_total < prev.prompt_tokens_total
            or stats.generation_tokens_total < prev.generation_tokens_total
        )
        self.kv_health.scraped(now, stats.prompt_tokens_total, stats.running + stats.waiting)
        if restarted:
            # the engine restarted (its KV cache is empty): drop its blocks from the index now,
            # not when its first new event arrives
            log.info("engine %s restarted: resetting its blocks", self.settings.engine_url)
            self.restarts.seen("metrics", now)  # (counted once if the events saw it too)
            self.translator.reset()
            self.probe.restarted()
            self._flush_now.set()
        self._last_stats, self._last_scrape_s = stats, now
        return stats

    async def _read_adapters(self, http: aiohttp.ClientSession) -> None:
        """The engine's LoRA adapters: its ``/v1/models`` entries that name a parent (vLLM lists
        each adapter with the base model as its parent). Kept as they were when the read
        fails; at most 256 names of at most 200 characters."""
        now = time.monotonic()
        if now - self._models_read_s < self.settings.models_interval_s:
            return
        self._models_read_s = now
        try:
            url = self.settings.engine_url.rstrip("/") + "/v1/models"
            async with http.get(url, headers=self._auth) as resp:
                resp.raise_for_status()
                listing = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("reading the models of %s failed: %s", self.settings.engine_url, exc)
            return
        data = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(data, list):
            return
        lengths = [
            m["max_model_len"]
            for m in data
            if isinstance(m, dict)
            and not m.get("parent")
            and type(m.get("max_model_len")) is int
            and 0 < m["max_model_len"] <= 1 << 30
        ]
        self.max_model_len = max(lengths) if lengths else self.max_model_len
        bases = [
            m
            for m in data
            if isinstance(m, dict)
            and not m.get("parent")
            and isinstance(m.get("id"), str)
            and 0 < len(m["id"]) <= 200
        ]
        if bases:
            root = bases[0].get("root")
            self.served_model = bases[0]["id"]
            self.model_source = root if isinstance(root, str) and 0 < len(root) <= 500 else None
        self.adapters = sorted(
            {
                m["id"]
                for m in data
                if isinstance(m, dict)
                and isinstance(m.get("id"), str)
                and 0 < len(m["id"]) <= 200
                and isinstance(m.get("parent"), str)
                and m["parent"]
            }
        )[:256]

    async def _probe(self, http: aiohttp.ClientSession) -> None:
        """Measure the engine's prefill rate (agents/probe.py) when it is due (this agent's
        start, an engine restart) and the engine was idle at the last scrape; at most
        ``prefill_probe_timeout_s``."""
        stats = self._last_stats
        if stats is None or not self.settings.prefill_probe:
            return
        model = self.served_model or stats.model_name
        idle = stats.running == 0 and stats.waiting == 0
        if model and self.probe.ready(time.time(), idle):
            try:
                await asyncio.wait_for(
                    self.probe.measure(http, model, self.max_model_len, time.time()),
                    self.settings.prefill_probe_timeout_s,
                )
            except TimeoutError:
                self.probe.failed(time.time())

    async def _probing(self, http: aiohttp.ClientSession) -> None:
        """Probe again whenever it is due (beside the heartbeats, which it never delays)."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await self._probe(http)

    async def _sglang_blocks(self, http: aiohttp.ClientSession, stats: EngineStats) -> int:
        if self._server_blocks is None:
            base = self.settings.engine_url.rstrip("/")
            for path in ("/get_server_info", "/server_info"):
                async with http.get(base + path) as resp:
                    if resp.status == 200:
                        info = await resp.json()
                        tokens = int(info.get("max_total_num_tokens") or 0)
                        self._server_blocks = tokens // stats.block_size
                        break
            else:
                self._server_blocks = 0
        return self._server_blocks

    async def _heartbeats(self, http: aiohttp.ClientSession) -> None:
        s = self.settings
        while True:
            started = time.monotonic()
            stats = await self._scrape(http)
            if stats is not None:
                await self._read_adapters(http)
            last = stats or self._last_stats
            if last is not None:
                hb = Heartbeat(
                    node_id=s.node_id,
                    epoch=self.epoch,
                    seq=self._hb_seq,
                    ts=time.time(),
                    endpoint=s.advertise_url or s.engine_url,
                    pool=s.pool,
                    model=last.model_name or "unknown",
                    model_source=self.model_source,
                    block_size=last.block_size,
                    kv_blocks_total=last.num_gpu_blocks,
                    kv_blocks_used=round(last.kv_usage * last.num_gpu_blocks),
                    kv_blocks_admissible=admissible_blocks(
                        last.num_gpu_blocks,
                        round(last.kv_usage * last.num_gpu_blocks),
                        s.fit_watermark,
                    ),
                    max_model_len=self.max_model_len,
                    running=last.running,
                    waiting=last.waiting,
                    prompt_tokens_per_s=self._rates[0],
                    prefill_tokens_per_s=self.probe.rate,
                    generation_tokens_per_s=self._rates[1],
                    prefix_cache_hit_rate=last.hit_rate(),
                    healthy=stats is not None,
                    lease_s=s.lease_s,
                    kv_seq=self._kv_seq - 1 if self._kv_seq else None,
                    kv_index=self._kv_state(),
                    engine_restarts=self.restarts.count,
                    kv_events_lost=self.engine_gaps,
                    kv_events_undecodable=self.undecodable,
                    kv_blocks_untranslatable=self.translator.untranslatable_blocks,
                    kv_blocks_skipped=sum(self.translator.skipped_blocks.values()),
                    adapters=self.adapters,
                    data_parallel_rank=s.data_parallel_rank,
                    engine_started_at=last.start_time_s,
                    labels=s.labels,
                    role=s.role,
                    kv_link_gbps=s.kv_link_gbps,
                    retention_hints=s.retention_hints,
                    kv_pull=s.kv_pull,
                    draining=self.draining,
                )
                self._hb_seq += 1
                await self.bus.publish(HEARTBEATS, s.node_id, hb)
            await asyncio.sleep(max(0.0, s.heartbeat_interval_s - (time.monotonic() - started)))

    # --- KV events -----------------------------------------------------------------------
    async def _subscribe(self, endpoint: str) -> None:
        """Engine KV events in sequence order (gaps filled from the engine's replay socket when
        it has one); an engine restart resets what the agent knows of its cache."""
        sub = KvEventSubscriber(
            endpoint, self.settings.kv_events_replay_endpoint, bind=self.settings.kv_events_bind
        )
        self.subscriber = sub
        async for seq, batch, restarted in sub.batches():
            if restarted:
                log.info("engine event sequence restarted at %d: resetting", seq)
                self.restarts.seen("events", time.time())
                self.translator.reset()
                self.probe.restarted()
            t = self.translator
            before = (t.translated_blocks, t.untranslatable_blocks)
            t.apply(batch)
            self.kv_health.batch(
                time.time(), t.translated_blocks - before[0], t.untranslatable_blocks - before[1]
            )
            if self.translator.pending >= self.settings.kv_flush_max_blocks:
                self._flush_now.set()

    def _kv_state(self) -> Literal["events", "approximate", "degraded"]:
        self.kv_index_state = self._kv_index()
        return self.kv_index_state

    @property
    def heartbeats(self) -> int:
        """Heartbeats published by this incarnation."""
        return self._hb_seq

    @property
    def kv_batches(self) -> int:
        """KV batches published by this incarnation."""
        return self._kv_seq

    def _kv_index(self) -> Literal["events", "approximate", "degraded"]:
        if not self.settings.kv_events_endpoint:
            return "approximate"
        if self.kv_health.degraded(time.time()):
            if not self._warned_degraded:
                log.warning(
                    "KV index of %s degraded: %s", self.settings.node_id, self.kv_health.reason
                )
                self._warned_degraded = True
            return "degraded"
        self._warned_degraded = False
        return "events"

    @property
    def engine_gaps(self) -> int:
        return self.subscriber.lost if self.subscriber is not None else 0

    @property
    def undecodable(self) -> int:
        """KV event batches and events the engine sent that could not be decoded."""
        sub = self.subscriber
        return sub.undecodable + sub.undecodable_events if sub is not None else 0

    async def _flusher(self) -> None:
        s = self.settings
        next_snapshot = time.monotonic() + s.snapshot_interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flush_now.wait(), s.kv_flush_interval_s)
            self._flush_now.clear()
            snapshot = time.monotonic() >= next_snapshot
            if snapshot:
                next_snapshot = time.monotonic() + s.snapshot_interval_s
            await self._publish_kv(snapshot=snapshot)

    async def _publish_kv(self, snapshot: bool) -> None:
        async with self._kv_lock:
            t = self.translator
            if snapshot:
                stored, removed, cleared, kind = t.snapshot(), [], False, "snapshot"
            else:
                delta = t.take_delta()
                if delta.empty:
                    return
                stored, removed, cleared, kind = delta.stored, delta.removed, delta.cleared, "delta"
            batch = KvEventBatch(
                node_id=self.settings.node_id,
                epoch=self.epoch,
                seq=self._kv_seq,
                ts=time.time(),
                kind=kind,
                block_size=t.block_size,
                stored=stored,
                removed=removed,
                cleared=cleared,
            )
            self._kv_seq += 1
            await self.bus.publish(KV_EVENTS, self.settings.node_id, batch)
