"""Wiring of a router process: Kafka bus, table replica, policy and HTTP service."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from router.policies import make_policy
from router.service import RouterService
from streams.kafka import KafkaBus, ensure_topics
from streams.replica import TableReplica

if TYPE_CHECKING:
    from deploy.settings import Settings

__all__ = ["build_router_app"]


def build_router_app(s: Settings) -> web.Application:
    bus = KafkaBus(s.kafka, "kvgate-router")
    replica = TableReplica(s.kafka, s.worker, "kvgate-router-replica")
    service = RouterService(s.router, replica, bus, make_policy(s.router), s.admission)
    app = service.app()

    async def start(_: web.Application) -> None:
        await ensure_topics(s.kafka)
        await bus.start()
        await replica.start()

    async def stop(_: web.Application) -> None:
        await replica.stop()
        await bus.stop()

    app.on_startup.insert(0, start)
    app.on_cleanup.append(stop)
    app["service"] = service
    return app
