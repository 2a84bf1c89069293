"""A router process (``kvgate router``): one router over Kafka (and Redis, with
``admission.backend=redis``) serving until SIGTERM / SIGINT, or ``router.workers`` of them.

``router.workers`` > 1 runs that many router processes on one port (``SO_REUSEPORT``: the kernel
spreads connections over them), each a whole router with its own replicas of the tables; worker
``i`` serves its admin listener on ``admin_port + i``. The parent only supervises: it restarts a
worker that dies and stops them all on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import signal
import time
from typing import Any

from admission.failover import FailoverReservations, FailoverStorm
from admission.rates import RateStore
from admission.reconciler import Reconciler
from admission.reservations import ReservationStore
from admission.storm import StormStore
from deploy.settings import Settings
from router.control import ControlFollower
from router.decision.policies import make_policy
from router.runtime import Router, build_router
from router.serve import event_loop_factory, start_listeners
from streams.kafka import KafkaBus, ensure_topics
from streams.ledger import LedgerReplica
from streams.replica import TableReplica

__all__ = ["router_process", "run_router", "worker_settings"]

log = logging.getLogger(__name__)


def _stores(
    s: Settings,
) -> tuple[ReservationStore | None, StormStore | None, RateStore | None, Any]:
    """The Redis-backed reservation, retry-storm and rate stores (``admission.backend=redis``),
    and their client to close; Nones in process."""
    if s.admission.backend != "redis":
        return None, None, None, None
    from admission.rates import RedisRates, SharedRates
    from admission.redis_connect import redis_client
    from admission.redis_store import RedisReservations
    from admission.storm import RedisStormStore

    client = redis_client(s.redis)
    prefix = f"kvgate:{s.kafka.namespace}"
    shared = RedisReservations(
        client, prefix, release_linger_s=s.admission.release_linger_ms / 1000
    )
    store = FailoverReservations(shared, s.admission.store_down_share)
    storm = FailoverStorm(RedisStormStore(client, prefix), store)
    return store, storm, SharedRates(RedisRates(client, prefix), store), (client, shared)


def router_process(s: Settings) -> Router:
    """A router process's :class:`Router` over Kafka (and Redis, with that backend): its
    ``app`` starts the bus, the table replica, the weights follower and, with admission on,
    the ledger and its reconciler, and stops them again."""
    bus = KafkaBus(s.kafka, "kvgate-router", linger_ms=s.router.records_linger_ms)
    replica = TableReplica(
        s.kafka, s.worker, "kvgate-router-replica", feed_stale_s=s.router.feed_stale_s
    )
    store, storm_store, rates, redis_handles = _stores(s)
    router = build_router(
        s.router, replica, bus, make_policy(s.router), s.admission, store, storm_store
    )
    if rates is not None:  # every router's, in Redis
        router.gate.rates.store = rates
    control = ControlFollower(
        s.kafka, bus, router.policy, f"{router.router_id}-control", router.director.fleet
    )
    control.on_scale = router.director.scaleroom.scale
    ledger = LedgerReplica(s.kafka, s.worker, f"{router.router_id}-ledger")
    reconciler = Reconciler(
        router.gate,
        ledger,
        lambda: replica.load.values(),
        s.admission.reconcile_interval_s,
        s.admission.reconcile_grace_s,
        sole_owner=s.admission.backend == "inproc",
        standby_s=s.admission.reconcile_standby_s,
    )
    router.loops.control, router.loops.reconciler = control, reconciler
    if isinstance(store, FailoverReservations):  # its share: 1 / the routers using the store
        store.routers = lambda: reconciler.routers_seen

    async def freeze_when_caught_up() -> None:
        # the index is a few large containers; keeping them out of the cyclic GC's scans
        # removes millisecond pauses from the decision path (docs/benchmarks/decision.md)
        await replica.caught_up.wait()
        gc.freeze()

    freeze: list[asyncio.Task[None]] = []

    async def start() -> None:
        await ensure_topics(s.kafka)
        await bus.start()
        await replica.start()
        await control.start()
        if s.admission.enabled:  # the reconciler follows the ledger while it may lead
            await reconciler.start()
        freeze.append(asyncio.create_task(freeze_when_caught_up()))

    async def stop() -> None:
        for task in freeze:
            task.cancel()
        await reconciler.stop()
        await ledger.stop()
        await control.stop()
        await replica.stop()
        await bus.stop()
        if redis_handles is not None:
            client, shared = redis_handles
            await shared.aclose()
            await client.aclose()

    router.app.on_startup.insert(0, start)
    router.app.on_cleanup.append(stop)
    return router


def worker_settings(s: Settings, index: int) -> Settings:
    """Worker ``index``'s settings: its own admin port (``admin_port + index``; 0 stays any
    free port) and router id (``<router_id>-w<index>`` when an id is configured)."""
    r = s.router
    update: dict[str, Any] = {}
    if r.admin_port:
        update["admin_port"] = r.admin_port + index
    if r.router_id is not None:
        update["router_id"] = f"{r.router_id}-w{index}"
    return s.model_copy(update={"router": r.model_copy(update=update)}) if update else s


def _serve(s: Settings) -> None:
    """One router process: serve until SIGTERM / SIGINT, then shut down cleanly."""

    async def main() -> None:
        router = router_process(s)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        listeners = await start_listeners(router.app, router.admin, s.router)
        log.info(
            "router %s listening on %s:%s (admin: %s, loop: %s)",
            router.router_id,
            s.router.host,
            s.router.port,
            listeners.ports[1] if len(listeners.ports) > 1 else None,
            type(loop).__module__.split(".")[0],
        )
        epp = None
        if s.router.epp_port is not None:  # the Gateway API Inference Extension's picker
            from router.epp import serve_epp

            epp = await serve_epp(router, s.router.host, s.router.epp_port)
            log.info("endpoint picker (ext_proc gRPC) on %s:%s", s.router.host, epp.port)
        try:
            await stop.wait()
        finally:
            if epp is not None:
                with contextlib.suppress(Exception):
                    await epp.stop()
            with contextlib.suppress(Exception):
                await listeners.stop()

    with asyncio.Runner(loop_factory=event_loop_factory(s.router.event_loop)) as runner:
        runner.run(main())


def run_router(s: Settings) -> None:
    """``kvgate router``: one router, or ``router.workers`` of them under a supervisor."""
    n = s.router.workers
    if n == 1:
        _serve(s)
        return
    if s.router.port == 0:
        raise SystemExit("router.workers > 1 needs a fixed router.port (the workers share it)")
    if s.admission.enabled and s.admission.backend != "redis":
        raise SystemExit(
            "router.workers > 1 runs several routers: they share one KV budget only with "
            "admission.backend=redis (each in-process store would admit against all of it)"
        )
    _supervise(s, n)


def _supervise(s: Settings, n: int, restart_backoff_s: float = 1.0) -> None:
    """Run ``n`` workers, restart one that exits while the parent runs (at most once per
    ``restart_backoff_s`` per worker), stop them all on SIGTERM / SIGINT."""
    ctx = multiprocessing.get_context("fork")  # nothing runs yet: no loop, no threads
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def start(i: int) -> multiprocessing.process.BaseProcess:
        p = ctx.Process(target=_serve, args=(worker_settings(s, i),), name=f"kvgate-router-{i}")
        p.start()
        log.info("router worker %d started (pid %s)", i, p.pid)
        return p

    workers = {i: start(i) for i in range(n)}
    started = dict.fromkeys(workers, time.monotonic())
    while not stopping:
        time.sleep(0.2)
        for i, p in list(workers.items()):
            if p.is_alive() or stopping:
                continue
            if time.monotonic() - started[i] < restart_backoff_s:
                continue
            log.error("router worker %d (pid %s) exited with %s; restarting", i, p.pid, p.exitcode)
            workers[i], started[i] = start(i), time.monotonic()
    for p in workers.values():
        if p.is_alive():
            p.terminate()  # SIGTERM: each worker shuts down cleanly
    deadline = time.monotonic() + 30.0
    for p in workers.values():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            log.error("router worker pid %s did not stop in time; killing it", p.pid)
            p.kill()
            p.join()
