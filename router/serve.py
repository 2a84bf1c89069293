"""Serving a router: its listeners, with the connection-level limits of ``router.*``.

* ``idle_timeout_s``: a connection that has not sent a complete request's headers for this long
  is closed, whether it sits idle between keep-alive requests or trickles its headers (slowloris);
* ``max_header_bytes`` / ``max_headers``: longer lines or more headers are a 400;
* ``max_connections``: connections beyond it (on one listener) get a 503 with ``Retry-After``
  before any request is parsed, and so do a client address's connections beyond
  ``max_connections_per_client`` (unless its network is in ``connection_share_exempt``): one
  client cannot hold the whole listener. Past the cap, a client address holding no connection
  still gets in, up to ``connection_headroom`` more (a liveness probe, a new tenant). The 503 is
  delivered, not reset: the router half-closes, reads and discards what the client sends for up
  to :data:`LINGER_S`, then closes;
* the admin listener (``admin_port``) binds ``admin_host`` (loopback by default).

With ``router.workers`` > 1 the main listener binds with ``SO_REUSEPORT`` (the processes of
deploy/routerproc.py share its port).

Body size and read time are bounded per request (:mod:`router.http.edge`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import TYPE_CHECKING, cast

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

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


LINGER_S = 2.0  # a refused connection is read (and discarded) this long before its close
_LINGER_BYTES = 64 << 10  # or until the client sent this much
_MAX_LINGERING = 1024  # refused connections lingering at once; past it, closed at once


class _Busy(asyncio.Protocol):
    """Answers one connection over the limit with a 503 and closes it once the client has read
    it: closing with the client's request unread would reset the connection, and a reset can
    destroy the 503 before the client reads it."""

    def __init__(self, listeners: Listeners) -> None:
        self.listeners = listeners
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses: never check the class)
        transport = cast("asyncio.Transport", transport)
        self.transport = transport
        transport.write(_BUSY)
        if self.listeners.lingering >= _MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        self.listeners.lingering += 1
        transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > _LINGER_BYTES and self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.listeners.lingering -= 1


class _Admit(asyncio.Protocol):
    """A new connection: handed to the HTTP server's own protocol (which then receives
    everything directly) when its listener and its client address have room, else a 503."""

    def __init__(self, gate: _ConnectionGate) -> None:
        self.gate = gate

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) and peer else ""
        protocol: asyncio.BaseProtocol
        if self.gate.admits(host):
            protocol = self.gate.handler()
        else:
            self.gate.listeners.refused_connections += 1
            protocol = _Busy(self.gate.listeners)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)


class _ConnectionGate:
    """Who may open one more connection on a listener: the listener's cap, each client
    address's share of it, the headroom for clients holding none."""

    def __init__(self, listeners: Listeners, handler: Server, r: RouterSettings) -> None:
        self.listeners, self.handler = listeners, handler
        self.limit, self.per_client = r.max_connections, r.max_connections_per_client
        self.headroom, self.exempt = r.connection_headroom, list(r.connection_share_exempt)
        self.by_client: Counter[str] = Counter()
        self.client_of: dict[RequestHandler, str] = {}
        made, lost = handler.connection_made, handler.connection_lost

        def connection_made(h: RequestHandler, transport: asyncio.Transport) -> None:
            peer = transport.get_extra_info("peername")
            host = peer[0] if isinstance(peer, tuple) and peer else ""
            self.client_of[h] = host
            self.by_client[host] += 1
            made(h, transport)

        def connection_lost(h: RequestHandler, exc: BaseException | None = None) -> None:
            host = self.client_of.pop(h, None)
            if host is not None:
                self.by_client[host] -= 1
                if self.by_client[host] <= 0:
                    del self.by_client[host]
            lost(h, exc)

        # the server's own bookkeeping of its connections, counted per client on the way
        handler.connection_made = connection_made  # type: ignore[method-assign,assignment]
        handler.connection_lost = connection_lost  # type: ignore[method-assign,assignment]

    def admits(self, host: str) -> bool:
        held = self.by_client.get(host, 0)
        total = len(self.handler.connections)
        if total >= self.limit and (held or total >= self.limit + self.headroom):
            return False
        return held < self.per_client or self._exempt(host)

    def _exempt(self, host: str) -> bool:
        if not self.exempt:
            return False
        try:
            address = ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.exempt)


@dataclass
class Listeners:
    runners: list[web.AppRunner] = field(default_factory=list)
    servers: list[asyncio.Server] = field(default_factory=list)
    refused_connections: int = 0
    lingering: int = 0  # refused connections being closed gracefully

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
    gate = _ConnectionGate(listeners, handler, r)

    def factory() -> asyncio.BaseProtocol:
        return _Admit(gate)

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
