"""The router's two aiohttp applications and their routes.

* The main listener: the OpenAI API for tenants (router/http/openai.py), the gateway API for
  gateways with their own key (router/http/gateway.py), the admin endpoints for admin keys, and
  probes and metrics for anyone.
* The admin listener (``router.admin_port``, loopback by default): the admin endpoints without
  credentials, probes and metrics.

Both run every path through :func:`~router.http.edge.path_guard` and answer every refusal the
same way (:func:`~router.http.edge.error_middleware`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from router.flow.headers import bearer_key, match_key
from router.flow.refusals import Refusal
from router.http.admin import AdminApi
from router.http.edge import error_middleware, path_guard
from router.http.gateway import GatewayApi
from router.http.openai import OpenAiApi
from router.http.passthrough import PASSTHROUGH_PATHS
from router.metrics import RouterMetrics
from router.settings import RouterSettings

__all__ = ["admin_app", "main_app"]

Handler = Callable[[web.Request], Awaitable[web.Response]]


def admin_only(settings: RouterSettings, metrics: RouterMetrics, handler: Handler) -> Handler:
    """``handler`` for callers with an admin key (``Authorization: Bearer <admin key>``)."""

    async def guarded(request: web.Request) -> web.Response:
        if match_key(settings.admin_keys, bearer_key(request.headers)) is None:
            metrics.rejected("admin_unauthorized")
            where = (
                f" or use the admin listener on {settings.admin_host}"
                if settings.admin_port is not None
                else ""
            )
            raise Refusal(401, f"an admin key is required{where}", "unauthorized")
        return await handler(request)

    return guarded


def _probes(app: web.Application, admin: AdminApi) -> None:
    app.router.add_get("/health", admin.health)
    app.router.add_get("/ready", admin.ready)
    app.router.add_get("/metrics", admin.metrics)


def main_app(
    settings: RouterSettings,
    metrics: RouterMetrics,
    openai: OpenAiApi,
    gateway: GatewayApi,
    admin: AdminApi,
) -> web.Application:
    app = web.Application(
        client_max_size=settings.max_body_bytes, middlewares=[error_middleware, path_guard]
    )
    route = app.router
    route.add_post("/v1/completions", openai.completions)
    route.add_post("/v1/chat/completions", openai.chat)
    route.add_post("/v1/kvgate/decide", admin_only(settings, metrics, admin.decide))
    route.add_post("/v1/kvgate/route", gateway.route)
    route.add_post("/v1/kvgate/release", gateway.release)
    route.add_post("/v1/kvgate/renew", gateway.renew)
    route.add_get("/v1/kvgate/state", admin_only(settings, metrics, admin.state))
    route.add_get("/v1/models", openai.models)
    # the engines' non-generating API (embeddings, score, rerank…): passed through by
    # model; nothing else under /v1 reaches an engine (router/http/passthrough.py)
    for path in PASSTHROUGH_PATHS:
        route.add_post(path, openai.passthrough)
    route.add_post("/v1/{tail:.+}", openai.not_served)
    _probes(app, admin)
    return app


def admin_app(admin: AdminApi) -> web.Application:
    """The admin listener's app. Its lifecycle is the main app's."""
    app = web.Application(client_max_size=1 << 20, middlewares=[error_middleware, path_guard])
    app.router.add_post("/v1/kvgate/decide", admin.decide)
    app.router.add_get("/v1/kvgate/state", admin.state)
    _probes(app, admin)
    return app
