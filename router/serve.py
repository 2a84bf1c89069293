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

The listeners serve on router/wire: body size (``max_body_bytes``) and read time
(``body_timeout_s``) are bounded per request there, before any handler runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import TYPE_CHECKING, cast

import orjson

from router.wire.server import Connection, Limits
from streams.openai import error_body

if TYPE_CHECKING:
    from router.http.app import Routes
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


class _Gate:
    """Who may open one more connection on a listener: the listener's cap, each client
    address's share of it, the headroom for clients holding none."""

    def __init__(self, listeners: Listeners, r: RouterSettings) -> None:
        self.listeners = listeners
        self.limit, self.per_client = r.max_connections, r.max_connections_per_client
        self.headroom, self.exempt = r.connection_headroom, list(r.connection_share_exempt)
        self.by_client: Counter[str] = Counter()
        self.open: set[Connection] = set()

    def admits(self, host: str) -> bool:
        held = self.by_client.get(host, 0)
        total = len(self.open)
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


class _Gated(Connection):
    """A connection its listener's gate admitted (counted per client until it closes), or
    answered with a 503 (:class:`_Busy`)."""

    def __init__(self, gate: _Gate, routes: Routes, limits: Limits) -> None:
        super().__init__(routes, limits, routes.screen)
        self.gate = gate
        self.counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        gate = self.gate
        if not gate.admits(host):
            gate.listeners.refused_connections += 1
            self.closed = True
            busy = _Busy(gate.listeners)
            transport.set_protocol(busy)
            busy.connection_made(transport)
            return
        self.counted = True
        gate.by_client[host] += 1
        gate.open.add(self)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.counted:
            self.counted = False
            gate = self.gate
            gate.open.discard(self)
            gate.by_client[self.peer] -= 1
            if gate.by_client[self.peer] <= 0:
                del gate.by_client[self.peer]
        super().connection_lost(exc)


@dataclass
class Listeners:
    servers: list[asyncio.Server] = field(default_factory=list)
    gates: list[_Gate] = field(default_factory=list)
    cleanup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    refused_connections: int = 0
    lingering: int = 0  # refused connections being closed gracefully

    @property
    def ports(self) -> list[int]:
        return [s.sockets[0].getsockname()[1] for s in self.servers if s.sockets]

    async def stop(self) -> None:
        """Stop listening, close every connection, then stop the router's parts."""
        for server in self.servers:
            server.close()
        for gate in self.gates:
            for conn in list(gate.open):
                conn.close()
        await asyncio.sleep(0)  # (the connections' tasks see their transports closed)
        for hook in self.cleanup:
            await hook()
        self.cleanup.clear()


def _limits(r: RouterSettings, max_body: int) -> Limits:
    return Limits(
        max_line=r.max_header_bytes,
        max_headers=r.max_headers,
        max_body=max_body,
        body_timeout_s=r.body_timeout_s,
        idle_timeout_s=r.idle_timeout_s,
    )


async def _listen(
    listeners: Listeners,
    routes: Routes,
    host: str,
    port: int,
    r: RouterSettings,
    reuse_port: bool = False,
) -> None:
    gate = _Gate(listeners, r)
    listeners.gates.append(gate)
    limits = _limits(r, routes.max_body)

    def factory() -> asyncio.BaseProtocol:
        return _Gated(gate, routes, limits)

    server = await asyncio.get_running_loop().create_server(
        factory, host, port, reuse_address=True, reuse_port=reuse_port or None, backlog=512
    )
    listeners.servers.append(server)


async def start_listeners(main: Routes, admin: Routes | None, r: RouterSettings) -> Listeners:
    """Start the main routes' parts (``on_startup``), then the main listener on
    ``r.host:r.port`` and, when ``admin`` is given and ``r.admin_port`` is set, the admin
    listener on ``r.admin_host:r.admin_port`` (port 0: any free port, see
    :attr:`Listeners.ports`). :meth:`Listeners.stop` undoes it all."""
    listeners = Listeners()
    for hook in main.on_startup:
        await hook()
    listeners.cleanup = list(main.on_cleanup)
    try:
        await _listen(listeners, main, r.host, r.port, r, reuse_port=r.workers > 1)
        if admin is not None and r.admin_port is not None:
            await _listen(listeners, admin, r.admin_host, r.admin_port, r)
    except BaseException:
        await listeners.stop()
        raise
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
