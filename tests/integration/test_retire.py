"""Dead nodes drop out: the worker retires a silent node from its tables and from routers."""

from __future__ import annotations

import time

import pytest

from deploy.procs import Supervisor
from streams.kafka import KafkaBus, ensure_topics
from streams.replica import TableReplica
from streams.schemas import KvEventBatch
from streams.settings import KafkaSettings, WorkerSettings
from streams.topics import HEARTBEATS, KV_EVENTS
from tests.conftest import wait_until
from tests.factories import heartbeat

pytestmark = pytest.mark.integration


async def test_silent_node_is_retired_from_tables_and_router_replicas(
    supervisor: Supervisor, kafka_settings: KafkaSettings, worker_settings: WorkerSettings
) -> None:
    await ensure_topics(kafka_settings)
    supervisor.env.update({"KVGATE_WORKER__NODE_TTL_S": "3", "KVGATE_WORKER__REAP_INTERVAL_S": "1"})
    supervisor.spawn("worker", "worker")
    bus = KafkaBus(kafka_settings, "t-retire")
    await bus.start()
    tables = TableReplica(kafka_settings, worker_settings, "t-tables", follow_input=False)
    router = TableReplica(kafka_settings, worker_settings, "t-router")
    try:
        for node in ("gone", "alive"):
            await bus.send(
                KV_EVENTS,
                node,
                KvEventBatch(
                    node_id=node,
                    epoch="e",
                    seq=0,
                    ts=time.time(),
                    kind="snapshot",
                    block_size=16,
                    stored=[1, 2, 3],
                ),
            )
        await tables.start()
        await router.start()

        async def beat(node: str) -> None:
            await bus.send(HEARTBEATS, node, heartbeat(node, seq=int(time.time() * 10)))

        async def beat_alive() -> None:
            await beat("alive")

        async def both_present() -> bool:
            # both beat until both are seen: a worker slow to start (a busy machine) would
            # otherwise fold "gone"'s only heartbeat already older than its 3 s TTL
            await beat("gone")
            await beat_alive()
            return all(
                len(r.index.blocks_of(n)) == 3 and n in r.load
                for r in (tables, router)
                for n in ("gone", "alive")
            )

        await wait_until(both_present, 60, "both nodes in the tables and the router", 0.5)

        async def gone_retired() -> bool:
            await beat_alive()
            return all(
                "gone" not in r.load and not r.index.blocks_of("gone") for r in (tables, router)
            )

        await wait_until(gone_retired, 30, "the silent node retired", 0.5)
        for r in (tables, router):
            assert "alive" in r.load and len(r.index.blocks_of("alive")) == 3
    finally:
        await tables.stop()
        await router.stop()
        await bus.stop()
