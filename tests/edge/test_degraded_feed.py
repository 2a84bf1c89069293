"""Kafka stops delivering: the router keeps serving on its last-known view, then on its own load
count over the engines that answer its probes, says so, and recovers on its own."""

from __future__ import annotations

import asyncio
import time

from tests.conftest import wait_until
from tests.edgekit import completion, edge


async def test_router_serves_through_a_silent_feed_and_recovers() -> None:
    router = {"feed_stale_s": 0.5, "degraded_view_s": 2.0, "probe_interval_s": 0.2}
    async with edge(router=router) as e:
        status, _, _ = await e.call("POST", "/v1/completions", completion())
        assert status == 200
        status, ready, _ = await e.call("GET", "/ready")
        assert status == 200 and ready["feed"] == "live"

        e.feeding = False  # no heartbeat from anyone: Kafka, not every node at once

        async def feed_is(state: str) -> bool:
            return (await e.call("GET", "/ready"))[1]["feed"] == state

        await wait_until(lambda: feed_is("last_known"), 5, "degraded: last-known view")
        status, ready, _ = await e.call("GET", "/ready")
        assert status == 200 and ready["ready"] and ready["healthy_nodes"] == 2
        # far past every heartbeat's lease, requests still go through, on both nodes
        await asyncio.sleep(1.0)
        for _ in range(4):
            status, out, _ = await e.call("POST", "/v1/completions", completion())
            assert status == 200, out

        # an engine dies while the feed is down: the probes take it out
        await e.stop_engine("n1")
        await asyncio.sleep(0.6)
        before = len(e.decisions())
        for i in range(6):
            status, out, _ = await e.call("POST", "/v1/completions", completion(f"q{i} " * 30))
            assert status == 200, out
        assert {d.chosen_node for d in e.decisions()[before:]} == {"n2"}

        await wait_until(lambda: feed_is("load_only"), 5, "degraded: load only")
        status, _, _ = await e.call("POST", "/v1/completions", completion())
        assert status == 200
        assert e.decisions()[-1].reason == "least_requests"
        metrics = (await e.call("GET", "/metrics"))[1]
        assert 'kvgate_router_degraded{mode="load_only"} 1.0' in metrics
        status, models, _ = await e.call("GET", "/v1/models")
        assert [m["id"] for m in models["data"]] == ["llama-3.1-8b"]

        e.feeding = True
        await wait_until(lambda: feed_is("live"), 5, "live again")
        metrics = (await e.call("GET", "/metrics"))[1]
        assert 'kvgate_router_degraded{mode="load_only"} 0.0' in metrics


async def test_a_second_router_on_in_process_stores_fails_readiness() -> None:
    """Two routers each keeping reservations in process would each admit against the whole
    budget: a router that sees another router's ledger events fails readiness and says why."""
    from admission.reconciler import Reconciler
    from streams.ledger import LedgerReplica
    from streams.settings import KafkaSettings, WorkerSettings

    async with edge() as e:
        ledger = LedgerReplica(KafkaSettings(), WorkerSettings(), "t-ledger")
        e.router.loops.reconciler = Reconciler(
            e.router.gate, ledger, lambda: e.router.replica.load.values(), sole_owner=True
        )
        status, ready, _ = await e.call("GET", "/ready")
        assert status == 200 and ready["failing"] == {}
        ledger.writers["a-dead-incarnation"] = time.time() - 3600  # before this router started
        assert (await e.call("GET", "/ready"))[0] == 200
        ledger.writers["another-router"] = time.time()
        status, ready, _ = await e.call("GET", "/ready")
        assert status == 503 and "another-router" in ready["failing"]["admission"]
        assert "admission.backend=redis" in ready["failing"]["admission"]
        # a loop that is down shows the same way
        del ledger.writers["another-router"]
        e.router.replica.failing = "lost Kafka: test"
        status, ready, _ = await e.call("GET", "/ready")
        assert status == 503 and ready["failing"] == {"replica": "lost Kafka: test"}
