"""Wiring of a router process: Kafka bus, table replica, policy and HTTP service."""

from __future__ import annotations

import asyncio
import gc
from typing import TYPE_CHECKING

from aiohttp import web

from admission.reconciler import Reconciler
from router.control import ControlFollower
from router.decision.policies import make_policy
from router.service import RouterService
from streams.kafka import KafkaBus, ensure_topics
from streams.ledger import LedgerReplica
from streams.replica import TableReplica

if TYPE_CHECKING:
    from deploy.settings import Settings

__all__ = ["build_router_app"]


def build_router_app(s: Settings) -> web.Application:
    bus = KafkaBus(s.kafka, "kvgate-router", linger_ms=s.router.records_linger_ms)
    replica = TableReplica(
        s.kafka, s.worker, "kvgate-router-replica", feed_stale_s=s.router.feed_stale_s
    )
    store = None
    storm_store = None
    redis_client = None
    if s.admission.backend == "redis":
        from redis.asyncio import BlockingConnectionPool, Redis

        from admission.redis_store import RedisReservations
        from admission.storm import RedisStormStore

        password = s.redis.password.get_secret_value() if s.redis.password else None
        # bounded, and waited for: redis-py's default pool refuses the 101st concurrent command
        # ("Too many connections"), which failed admissions and releases under load
        pool = BlockingConnectionPool.from_url(
            s.redis.url,
            password=password,
            socket_timeout=s.redis.socket_timeout_s,
            max_connections=s.redis.max_connections,
            timeout=s.redis.pool_timeout_s,
        )
        redis_client = Redis.from_pool(pool)  # closing the client closes the pool
        store = RedisReservations(redis_client, f"kvgate:{s.kafka.namespace}")
        storm_store = RedisStormStore(redis_client, f"kvgate:{s.kafka.namespace}")
    service = RouterService(
        s.router, replica, bus, make_policy(s.router), s.admission, store, storm_store
    )
    control = ControlFollower(
        s.kafka, bus, service.policy, f"{service.router_id}-control", service.fleet
    )
    service.control = control
    ledger = LedgerReplica(s.kafka, s.worker, f"{service.router_id}-ledger")
    reconciler = Reconciler(
        service.gate,
        ledger,
        lambda: replica.load.values(),
        s.admission.reconcile_interval_s,
        s.admission.reconcile_grace_s,
        sole_owner=s.admission.backend == "inproc",
    )
    service.reconciler = reconciler
    app = service.app()

    async def freeze_when_caught_up() -> None:
        # the index is a few large containers; keeping them out of the cyclic GC's scans
        # removes millisecond pauses from the decision path (docs/benchmarks/decision.md)
        await replica.caught_up.wait()
        gc.freeze()

    async def start(app: web.Application) -> None:
        await ensure_topics(s.kafka)
        await bus.start()
        await replica.start()
        await control.start()
        if s.admission.enabled:
            await ledger.start()
            await reconciler.start()
        app["freeze"] = asyncio.create_task(freeze_when_caught_up())

    async def stop(_: web.Application) -> None:
        await reconciler.stop()
        await ledger.stop()
        await control.stop()
        await replica.stop()
        await bus.stop()
        if redis_client is not None:
            await redis_client.aclose()

    app.on_startup.insert(0, start)
    app.on_cleanup.append(stop)
    app["service"] = service
    return app
