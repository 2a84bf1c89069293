"""A small HTTP listener for a component's Prometheus metrics (``/metrics``) and ``/health``:
the agent and the sink, whose work is not HTTP, serve their figures on it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

__all__ = ["serve_metrics"]


async def serve_metrics(
    host: str,
    port: int,
    registry: CollectorRegistry,
    before: Callable[[], Awaitable[None]] | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve ``registry`` on ``host:port`` (0: any free port); ``before`` runs before each
    scrape (to refresh what is read on demand). Returns the runner and the bound port."""

    async def metrics(_: web.Request) -> web.Response:
        if before is not None:
            await before()
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    for address in runner.addresses:  # the bound port when asked for 0
        bound = int(address[1])
    return runner, bound
