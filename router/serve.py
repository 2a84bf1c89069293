"""Serving a router: its listeners, with the connection-level limits of ``router.*``.

* ``idle_timeout_s``: a connection that has not sent a complete request's headers for this long
  is closed, whether it sits idle between keep-alive requests or trickles its headers (slowloris);
* ``max_header_bytes`` / ``max_headers``: longer lines or more headers are a 400;
* ``max_connections``: connections beyond it (on one listener) get a 503 with ``Retry-After``
  and are closed at once, before any request is parsed;
* the admin listener (``admin_port``) binds ``admin_host`` (loopback by default).

``router.workers`` > 1 runs that many router processes on one port (``SO_REUSEPORT``: the kernel
spreads connections over them), each a whole router with its own replicas of the tables; worker
``i`` serves its admin listener on ``admin_port + i``. The parent only supervises: it restarts a
worker that dies and stops them all on SIGTERM / SIGINT.

Body size and read time are bounded per request (:mod:`router.http.edge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from streams.openai import error_body

if TYPE_CHECKING:
    from deploy.settings import Settings
    from router.settings import RouterSettings

__all__ = ["Listeners", "event_loop_factory", "run_router", "start_listeners", "worker_settings"]

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
    from router.runtime import build_router_app

    async def main() -> None:
        app = build_router_app(s)
        admin = app["service"].admin_app()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        listeners = await start_listeners(app, admin, s.router)
        log.info(
            "router %s listening on %s:%s (admin: %s, loop: %s)",
            app["service"].router_id,
            s.router.host,
            s.router.port,
            listeners.ports[1] if len(listeners.ports) > 1 else None,
            type(loop).__module__.split(".")[0],
        )
        epp = None
        if s.router.epp_port is not None:  # the Gateway API Inference Extension's picker
            from router.epp import serve_epp

            epp = await serve_epp(app["service"], s.router.host, s.router.epp_port)
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
