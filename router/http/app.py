"""The router's two HTTP applications: their routes, each route's screen, and the one place a
refusal or an unexpected error becomes an answer.

* The main listener: the OpenAI API for tenants (router/http/openai.py), the gateway API for
  gateways with their own key (router/http/gateway.py), the admin endpoints for admin keys, and
  probes and metrics for anyone.
* The admin listener (``router.admin_port``, loopback by default): the admin endpoints without
  credentials, probes and metrics.

Both serve on router/wire. Once a request's headers are in, and before its body is read,
:meth:`Routes.screen` refuses a path not in normal form (400), an unknown path (404), a
method the path does not serve (405), and runs the route's own screen (authentication, the
checks of the headers): its result goes with the request to the handler.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from router.flow.headers import bearer_key, match_key
from router.flow.refusals import Refusal
from router.http.admin import AdminApi
from router.http.edge import json_answer, path_guard, refused, send_refusal
from router.http.gateway import GatewayApi
from router.http.openai import OpenAiApi
from router.http.passthrough import PASSTHROUGH_PATHS
from router.metrics import RouterMetrics
from router.settings import RouterSettings
from router.wire.server import Headers, Reply, Request
from streams.openai import error_body

__all__ = ["Handler", "Routes", "admin_routes", "main_routes"]

log = logging.getLogger(__name__)

Handler = Callable[[Request, Reply], Awaitable[None]]
# a route's check of a request's headers (and the client's address) before its body is read:
# raises Refusal; what it returns is the handler's ``request.screened``
RouteScreen = Callable[[Headers, str], Any]
Hook = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Route:
    handler: Handler
    screen: RouteScreen | None = None


@dataclass
class Routes:
    """Exact paths by method, and the handler of every other ``POST /v1/…``. ``on_startup``
    runs before the listeners open, ``on_cleanup`` after they closed."""

    max_body: int
    paths: dict[str, dict[str, Route]] = field(default_factory=dict)
    v1_post: Route | None = None
    on_startup: list[Hook] = field(default_factory=list)
    on_cleanup: list[Hook] = field(default_factory=list)

    def add(
        self, method: str, path: str, handler: Handler, screen: RouteScreen | None = None
    ) -> None:
        self.paths.setdefault(path, {})[method] = Route(handler, screen)

    def screen(self, method: str, path: str, headers: Headers, peer: str) -> Any:
        """The listener's screen: the route and what its own screen found; a refusal as the
        listener's answer."""
        try:
            if path not in self.paths:  # (a path served is in normal form)
                path_guard(path)
            route = self._route(method, path)
            return route, (route.screen(headers, peer) if route.screen is not None else None)
        except Refusal as exc:
            raise refused(exc) from None

    def _route(self, method: str, path: str) -> Route:
        methods = self.paths.get(path)
        if methods is not None:
            route = methods.get(method)
            if route is not None:
                return route
            raise Refusal(405, "Method Not Allowed", headers={"Allow": ", ".join(methods)})
        if method == "POST" and self.v1_post is not None and path.startswith("/v1/"):
            return self.v1_post
        raise Refusal(404, f"no route for {path[:200]!r}", "NotFoundError")

    async def __call__(self, request: Request, reply: Reply) -> None:
        """Answer one request: its route's handler; a refusal, or a 500 that names nothing
        internal (the log has the error)."""
        route: Route = request.screened[0]
        try:
            await route.handler(request, reply)
        except Refusal as exc:
            if not reply.started:
                send_refusal(reply, exc)
        except (ConnectionError, OSError):
            raise
        except Exception:
            log.exception("unexpected error on %s %s", request.method, request.path[:200])
            if not reply.started:
                body = error_body("internal error in the router", "internal_error", 500)
                json_answer(reply, body, 500)
            else:
                raise


def admin_only(settings: RouterSettings, metrics: RouterMetrics) -> RouteScreen:
    """Callers with an admin key (``Authorization: Bearer <admin key>``)."""

    def screen(headers: Headers, _: str) -> None:
        if match_key(settings.admin_keys, bearer_key(headers)) is None:
            metrics.rejected("admin_unauthorized")
            where = (
                f" or use the admin listener on {settings.admin_host}"
                if settings.admin_port is not None
                else ""
            )
            raise Refusal(401, f"an admin key is required{where}", "unauthorized")

    return screen


def _probes(routes: Routes, admin: AdminApi) -> None:
    routes.add("GET", "/health", admin.health)
    routes.add("GET", "/ready", admin.ready)
    routes.add("GET", "/metrics", admin.metrics)


def main_routes(
    settings: RouterSettings,
    metrics: RouterMetrics,
    openai: OpenAiApi,
    gateway: GatewayApi,
    admin: AdminApi,
) -> Routes:
    routes = Routes(settings.max_body_bytes)
    admins = admin_only(settings, metrics)
    routes.add("POST", "/v1/completions", openai.completions, openai.screen)
    routes.add("POST", "/v1/chat/completions", openai.chat, openai.screen)
    routes.add("POST", "/v1/messages", openai.messages, openai.screen)
    routes.add("POST", "/v1/responses", openai.responses, openai.screen)
    routes.add("POST", "/v1/kvgate/decide", admin.decide, admins)
    routes.add("POST", "/v1/kvgate/route", gateway.route, gateway.screen_route)
    routes.add("POST", "/v1/kvgate/release", gateway.release, gateway.screen)
    routes.add("POST", "/v1/kvgate/renew", gateway.renew, gateway.screen)
    routes.add("GET", "/v1/kvgate/state", admin.state, admins)
    routes.add("GET", "/v1/models", openai.models, openai.screen_tenant)
    # the engines' non-generating API (embeddings, score, rerank…): passed through by
    # model; nothing else under /v1 reaches an engine (router/http/passthrough.py)
    for path in PASSTHROUGH_PATHS:
        routes.add("POST", path, openai.passthrough, openai.screen_tenant)
    routes.v1_post = Route(openai.not_served)
    _probes(routes, admin)
    return routes


def admin_routes(admin: AdminApi) -> Routes:
    """The admin listener's routes. Its lifecycle is the main listener's."""
    routes = Routes(1 << 20)
    routes.add("POST", "/v1/kvgate/decide", admin.decide)
    routes.add("GET", "/v1/kvgate/state", admin.state)
    _probes(routes, admin)
    return routes
