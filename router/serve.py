"""Serving a router: its listeners, with the connection-level limits of ``router.*``.

* ``idle_timeout_s``: a connection that has not sent a complete request's headers for this long
  is closed, whether it sits idle between keep-alive requests or trickles its headers (slowloris);
* ``max_header_bytes`` / ``max_headers``: longer lines or more headers are a 400;
* ``max_connections``: connections beyond it (on one listener) get a 503 with ``Retry-After``
  and are closed at once, before any request is parsed;
* the admin listener (``admin_port``) binds ``admin_host`` (loopback by default).

With ``router.workers`` > 1 the main listener binds with ``SO_REUSEPORT`` (the processes of
deploy/routerproc.py share its port).

Body size and read time are bounded per request (:mod:`router.http.edge`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from streams.openai import error_body

if TYPE_CHECKING:
    from router.settings import RouterSettings

__all__ = ["Listeners", "event_loop_factory", "start_listeners"]

log = logging.getLogger(__name__)

_BUSY_BODY = orjson.dumps(
    error_body("the router has too many open connections", "ServiceUnavailableError", 503)
)
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n"
) + _BUSY_BODY


class _Busy(asyncio.Protocol):
    """Answers one connection over the limit with a 503 and closes it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_BUSY)
        transport.close()


@dataclass
class Listeners:
    runners: list[web.AppRunner] = field(default_factory=list)
    servers: list[asyncio.Server] = field(default_factory=list)
    refused_connections: int = 0

    @property
    def ports(self) -> list[int]:
        return [s.sockets[0].getsockname()[1] for s in self.servers if s.sockets]

    async def stop(self) -> None:
        for server in self.servers:
            server.close()
        for runner in reversed(self.runners):  # the main app last: its cleanup stops the bus
            await runner.cleanup()


async def _listen(
    listeners: Listeners,
    app: web.Application,
    host: str,
    port: int,
    r: RouterSettings,
    reuse_port: bool = False,
) -> None:
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=r.idle_timeout_s,
        max_line_size=r.max_header_bytes,
        max_field_size=r.max_header_bytes,
        max_headers=r.max_headers,
    )
    await runner.setup()
    listeners.runners.append(runner)
    handler = runner.server
    assert handler is not None
    limit = r.max_connections

    def factory() -> asyncio.BaseProtocol:
        if len(handler.connections) >= limit:
            listeners.refused_connections += 1
            return _Busy()
        return handler()

    server = await asyncio.get_running_loop().create_server(
        factory, host, port, reuse_address=True, reuse_port=reuse_port or None, backlog=512
    )
    listeners.servers.append(server)


async def start_listeners(
    main: web.Application, admin: web.Application | None, r: RouterSettings
) -> Listeners:
    """The main listener on ``r.host:r.port`` and, when ``admin`` is given and
    ``r.admin_port`` is set, the admin listener on ``r.admin_host:r.admin_port`` (port 0:
    any free port, see :attr:`Listeners.ports`)."""
    listeners = Listeners()
    await _listen(listeners, main, r.host, r.port, r, reuse_port=r.workers > 1)
    if admin is not None and r.admin_port is not None:
        await _listen(listeners, admin, r.admin_host, r.admin_port, r)
    return listeners


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a router runs on (``router.event_loop``); None: asyncio's default."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("router.event_loop is uvloop, but uvloop is not installed") from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
