"""Faults: kill the Faust worker mid-stream (SIGKILL and SIGTERM, with and without exactly-once)
and kill a router mid-run. The tables must end exactly equal to the state the input implies."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from deploy.procs import Supervisor, free_port
from streams.codec import encode
from streams.kafka import KafkaBus, ensure_topics
from streams.replica import TableReplica
from streams.schemas import Heartbeat
from streams.settings import KafkaSettings, WorkerSettings
from streams.tables import app_id
from streams.topics import HEARTBEATS, KV_EVENTS
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, get, long_prompt, post
from tests.integration.streamgen import Expected, expected_state, synthetic_stream

pytestmark = [pytest.mark.integration, pytest.mark.fault]


def _diff(replica: TableReplica, exp_blocks: dict[str, set[int]]) -> str:
    lines = []
    for node, blocks in sorted(exp_blocks.items()):
        have = replica.index.blocks_of(node)
        if have != blocks:
            lines.append(f"{node}: missing {len(blocks - have)}, extra {len(have - blocks)}")
    extra_nodes = set(replica.index.nodes()) - set(exp_blocks)
    if extra_nodes:
        lines.append(f"unexpected nodes {extra_nodes}")
    return "; ".join(lines)


@pytest.mark.parametrize(
    ("sig", "exactly_once"),
    [
        (signal.SIGKILL, False),
        (signal.SIGTERM, False),
        (signal.SIGTERM, True),
        (signal.SIGKILL, True),
    ],
    ids=[
        "kill9-at-least-once",
        "sigterm-at-least-once",
        "sigterm-exactly-once",
        "kill9-exactly-once",
    ],
)
async def test_worker_killed_mid_stream_tables_equal_recomputed_state(
    supervisor: Supervisor,
    kafka_settings: KafkaSettings,
    worker_settings: WorkerSettings,
    sig: signal.Signals,
    exactly_once: bool,
) -> None:
    stream = synthetic_stream()
    exp = expected_state(stream)
    async with _worker_input(
        supervisor, kafka_settings, worker_settings, "faults", exactly_once
    ) as (bus, replica):
        supervisor.spawn("worker-1", "worker")
        third = len(stream) // 3
        for msg in stream[:third]:
            spec = HEARTBEATS if isinstance(msg, Heartbeat) else KV_EVENTS
            await bus.publish(spec, msg.node_id, msg)  # type: ignore[attr-defined]
        await bus.flush()
        await replica.start()
        await wait_until(lambda: _progress(replica), 90, "the first worker to fold some input")
        # keep producing while the worker dies
        producer = asyncio.create_task(_produce(bus, stream[third:]))
        await asyncio.sleep(0.3)
        supervisor.kill("worker-1", sig)
        folded_before_restart = replica.records
        await producer
        supervisor.spawn("worker-2", "worker")
        await _tables_become_exact(replica, exp)
        assert folded_before_restart > 0
        total = sum(len(b) for b in exp.blocks.values())
        assert replica.index.entries == total
        # a router's replica (tables + the input from the worker's committed offsets) agrees
        router_view = TableReplica(kafka_settings, worker_settings, "t-faults-router")
        await router_view.start()
        try:
            await wait_until(lambda: _caught_up(router_view), 60, "the router replica")
            assert not _diff(router_view, exp.blocks)
            assert {n: (h.epoch, h.seq) for n, h in router_view.load.items()} == exp.last_heartbeat
        finally:
            await router_view.stop()


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
async def test_a_worker_joining_and_another_dying_mid_stream_keep_the_tables_exact(
    supervisor: Supervisor,
    kafka_settings: KafkaSettings,
    worker_settings: WorkerSettings,
    tmp_path: Path,
    exactly_once: bool,
) -> None:
    """Two rebalances while the input flows: a second worker joins (the first keeps some
    partitions, with changes it has not written yet, and gives the others away), then the first
    is killed -9 (the second takes its partitions from the committed tables and offsets)."""
    stream = synthetic_stream(nodes=12, steps=3000, seed=5)
    exp = expected_state(stream)
    async with _worker_input(
        supervisor, kafka_settings, worker_settings, "rebalance", exactly_once
    ) as (bus, replica):
        quarter = len(stream) // 4
        await _first_worker_folds(supervisor, bus, replica, stream[:quarter])
        producer = asyncio.create_task(_produce(bus, stream[quarter:], every=20, pause=0.08))
        supervisor.spawn(
            "worker-2",
            "worker",
            env={
                "KVGATE_WORKER__WEB_PORT": str(free_port()),
                "KVGATE_WORKER__DATA_DIR": str(tmp_path / "worker-2"),
            },
        )
        await asyncio.sleep(9.0)  # the join's rebalance happens while the input flows
        supervisor.kill("worker-1", signal.SIGKILL)
        await producer
        await _tables_become_exact(replica, exp)
        assert replica.index.entries == sum(len(b) for b in exp.blocks.values())


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
async def test_a_recovery_that_loses_its_changelog_records_reads_them_again(
    supervisor: Supervisor,
    kafka_settings: KafkaSettings,
    worker_settings: WorkerSettings,
    exactly_once: bool,
) -> None:
    """A worker taking over tables whose recovery loses every changelog record it was about to
    read (:mod:`tests.lossyworker`: the consumer's positions at the changelogs' ends, as Faust
    leaves them when it drops a fetched batch around a rebalance) finds the stall, reads the
    records again, and folds on with the tables it restored: the tables end exact, no KV batch
    history is missing from its state, and its /metrics counts the re-reads. Without the re-read
    the recovery never ends (at-least-once), or Faust takes the missing records for aborted
    transactions after 10 s and starts from empty tables (exactly-once)."""
    stream = synthetic_stream(nodes=8, steps=1500, seed=11)
    exp = expected_state(stream)
    async with _worker_input(
        supervisor, kafka_settings, worker_settings, "lossy", exactly_once
    ) as (bus, replica):
        half = len(stream) // 2
        await _first_worker_folds(supervisor, bus, replica, stream[:half])
        supervisor.kill("worker-1", signal.SIGTERM)
        written = replica.records
        await _produce(bus, stream[half:])
        supervisor.spawn_argv("worker-2", [sys.executable, "-m", "tests.lossyworker", "worker"])
        await _tables_become_exact(replica, exp)
        assert written > 0  # the second worker had tables to restore
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{worker_settings.web_port}/metrics"
            async with http.get(url) as resp:
                text = await resp.text()
        rereads = [line for line in text.splitlines() if line.startswith("kvgate_worker_recovery")]
        assert rereads and float(rereads[0].split()[-1]) >= 1, rereads
        log = supervisor.procs["worker-2"].log.read_text(errors="replace")
        assert "were lost" not in log, log[-2000:]  # its restored state holds every KV batch


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
async def test_input_with_transaction_markers_and_aborted_records_is_folded_and_committed(
    supervisor: Supervisor,
    kafka_settings: KafkaSettings,
    worker_settings: WorkerSettings,
    exactly_once: bool,
) -> None:
    """Input written in Kafka transactions has offsets that hold no record (commit and abort
    markers; aborted records too, for a ``read_committed`` worker). The worker folds each
    partition in offset order and commits only what it folded: it must step over those offsets
    (asking the broker), not wait for them, and its committed offsets must cover every record."""
    await ensure_topics(kafka_settings)
    supervisor.env["KVGATE_WORKER__EXACTLY_ONCE"] = str(exactly_once).lower()
    stream = synthetic_stream(nodes=4, steps=300, seed=11)
    exp = expected_state(stream)
    producer = AIOKafkaProducer(
        **kafka_settings.client_options(), transactional_id=f"{kafka_settings.namespace}-gaps"
    )
    await producer.start()
    replica = TableReplica(kafka_settings, worker_settings, "t-gaps-replica", follow_input=False)
    last: dict[tuple[str, int], int] = {}  # (topic, partition) -> offset of its last record
    try:
        supervisor.spawn("worker-1", "worker")
        sent: list[object] = []
        for start in range(0, len(stream), 25):
            for abort in (False, True):
                # an aborted transaction re-sends earlier records: folded again (read
                # uncommitted) they change nothing; skipped (read committed) they leave holes
                chunk = stream[start : start + 25] if not abort else sent[-10:]
                async with producer.transaction() if not abort else _aborted(producer):
                    for msg in chunk:
                        spec = HEARTBEATS if isinstance(msg, Heartbeat) else KV_EVENTS
                        meta = await (
                            await producer.send(
                                spec.name(kafka_settings.namespace),
                                encode(msg),  # type: ignore[arg-type]
                                key=msg.node_id.encode(),  # type: ignore[attr-defined]
                            )
                        )
                        if not abort:
                            last[(meta.topic, meta.partition)] = meta.offset
                if not abort:
                    sent.extend(chunk)
        await replica.start()
        await _tables_become_exact(replica, exp)

        async def committed_everything() -> bool:
            offsets = await _committed(kafka_settings, app_id(kafka_settings, worker_settings))
            return all(offsets.get(tp, -1) > offset for tp, offset in last.items())

        await wait_until(committed_everything, 30, "committed offsets past every record", 0.5)
    finally:
        await replica.stop()
        await producer.stop()


class _aborted:
    """A transaction that is aborted when the block ends."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer

    async def __aenter__(self) -> None:
        await self.producer.begin_transaction()

    async def __aexit__(self, *_: object) -> None:
        await self.producer.abort_transaction()


@contextlib.asynccontextmanager
async def _worker_input(
    supervisor: Supervisor,
    kafka: KafkaSettings,
    worker: WorkerSettings,
    label: str,
    exactly_once: bool,
) -> AsyncIterator[tuple[KafkaBus, TableReplica]]:
    """The topics, the workers' mode, a bus to write their input and a replica that follows the
    changelogs only (it shows exactly what the workers' tables hold; started by the test)."""
    await ensure_topics(kafka)
    supervisor.env["KVGATE_WORKER__EXACTLY_ONCE"] = str(exactly_once).lower()
    bus = KafkaBus(kafka, f"t-{label}")
    await bus.start()
    replica = TableReplica(kafka, worker, f"t-{label}-replica", follow_input=False)
    try:
        yield bus, replica
    finally:
        await replica.stop()
        await bus.stop()


async def _first_worker_folds(
    supervisor: Supervisor, bus: KafkaBus, replica: TableReplica, msgs: list[object]
) -> None:
    """``worker-1`` started on ``msgs`` of input; the replica started and following the tables
    it has begun to write."""
    supervisor.spawn("worker-1", "worker")
    await _produce(bus, msgs)
    await replica.start()
    await wait_until(lambda: _progress(replica), 90, "the first worker to fold some input")


async def _committed(kafka: KafkaSettings, group: str) -> dict[tuple[str, int], int]:
    admin = AIOKafkaAdminClient(**kafka.client_options())
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()}


async def _tables_become_exact(replica: TableReplica, exp: Expected) -> None:
    """Wait until the tables hold exactly the state the input implies (or fail with the diff)."""

    async def exact() -> bool:
        done = all(
            (hb.epoch, hb.seq) == exp.last_heartbeat[node] for node, hb in replica.load.items()
        ) and set(replica.load) == set(exp.last_heartbeat)
        return done and not _diff(replica, exp.blocks)

    try:
        await wait_until(exact, 120, "tables equal to the recomputed state", 0.25)
    except AssertionError:
        raise AssertionError(
            f"tables differ from the input: {_diff(replica, exp.blocks)}; "
            f"load={ {n: (h.epoch, h.seq) for n, h in replica.load.items()} } "
            f"expected={exp.last_heartbeat}"
        ) from None


async def _caught_up(replica: TableReplica) -> bool:
    return replica.caught_up.is_set()


async def _progress(replica: TableReplica) -> bool:
    return replica.records > 0


async def _produce(bus: KafkaBus, msgs: list[object], every: int = 50, pause: float = 0.02) -> None:
    for i, msg in enumerate(msgs):
        spec = HEARTBEATS if isinstance(msg, Heartbeat) else KV_EVENTS
        await bus.publish(spec, msg.node_id, msg)  # type: ignore[attr-defined]
        if i % every == 0:
            await asyncio.sleep(pause)
    await bus.flush()


async def test_router_killed_mid_run_a_new_router_rebuilds_and_routes(
    supervisor: Supervisor, kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    await ensure_topics(kafka_settings)
    c, first = await Cluster.two_nodes(supervisor, "router-a")
    prompts = [long_prompt(f"doc{i}") for i in range(6)]
    holders: dict[str, str] = {}
    for p in prompts:
        status, _ = await post(
            first, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2}
        )
        assert status == 200

    async def all_indexed() -> bool:
        for p in prompts:
            _, d = await post(first, "/v1/kvgate/decide", {"model": MODEL, "prompt": p})
            best = max(d["candidates"], key=lambda x: x["hit_blocks"])
            if best["hit_blocks"] == 0:
                return False
            holders[p] = best["node_id"]
        return True

    await wait_until(all_indexed, 5, "every prompt indexed in router-a")
    # requests in flight when the router dies
    inflight = [
        asyncio.create_task(
            post(
                first,
                "/v1/completions",
                {"model": MODEL, "prompt": p, "max_tokens": 200, "stream": True},
            )
        )
        for p in prompts
    ]
    await asyncio.sleep(0.3)
    supervisor.kill("router-a", signal.SIGKILL)
    results = await asyncio.gather(*inflight, return_exceptions=True)
    assert any(isinstance(r, Exception) for r in results)  # they really were cut off

    second = c.add_router("router-b")
    await c.wait_ready("router-b", 2)
    state = await get(second, "/v1/kvgate/state")
    assert state["replica_caught_up"] and state["indexed_blocks"] > 0
    for p in prompts:
        _, d = await post(second, "/v1/kvgate/decide", {"model": MODEL, "prompt": p})
        hits = {x["node_id"]: x["hit_blocks"] for x in d["candidates"]}
        # the rebuilt index knows the prefix: the new router sends it to a node holding it (the
        # in-flight copies may have put it on the other node too, so either holder is right)
        assert hits[holders[p]] > 0, (d, holders[p])
        assert hits[d["chosen_node"]] > 0 and d["reason"] == "prefix_hit", d
        status, _ = await post(
            second, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2}
        )
        assert status == 200
