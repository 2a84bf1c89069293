"""An in-process router in front of in-process simulated engines, over real sockets.

For the tests of the router's HTTP edge (auth, limits, ids, stalls, degraded feed): the router
runs with its real listeners (:func:`router.serve.start_listeners`), the engines are real
:class:`agents.simengine.SimEngine` servers, and the replica is fed heartbeats directly instead of
through Kafka (the Kafka bus is never started: what the router publishes stays in its outbox,
where tests read it). The pipeline itself is tested against real Kafka elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from admission.settings import AdmissionSettings, Tenant
from agents.profile import EngineProfile
from agents.settings import EngineSettings
from agents.simengine import SimEngine
from router.decision.policies import make_policy
from router.runtime import Router, build_router
from router.serve import Listeners, start_listeners
from router.settings import RouterSettings
from router.tracing import Tracing
from streams.codec import decode
from streams.kafka import KafkaBus
from streams.replica import TableReplica
from streams.schemas import Decision, Heartbeat
from streams.settings import KafkaSettings, WorkerSettings
from streams.topics import DECISIONS

MODEL = "llama-3.1-8b"
T = TypeVar("T")
ADMIN = "admin-key-0123"
GATEWAY = "gateway-key-0123"
OTHER_GATEWAY = "gateway-key-4567"
TENANTS = {
    "sk-alpha": Tenant(name="alpha", priority="normal"),
    "sk-beta": Tenant(name="beta", priority="normal"),
}


class LoopThread:
    """An event loop in a thread: hypothesis drives synchronous examples against it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@dataclass
class Edge:
    router: Router
    url: str
    admin_url: str | None
    engines: dict[str, str]
    listeners: Listeners
    http: aiohttp.ClientSession
    feeding: bool = True
    beats: dict[str, Heartbeat] = field(default_factory=dict)
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> heartbeat fields
    runners: dict[str, web.AppRunner] = field(default_factory=dict)
    sims: dict[str, SimEngine] = field(default_factory=dict)  # the engines themselves

    async def stop_engine(self, node: str) -> None:
        """The engine process goes away (its last heartbeat stays where it was)."""
        await self.runners.pop(node).cleanup()

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        *,
        base: str | None = None,
        data: bytes | None = None,
    ) -> tuple[int, Any, CIMultiDict[str]]:
        kwargs: dict[str, Any] = {"headers": headers or {}}
        if data is not None:
            kwargs["data"] = data
        elif body is not None:
            kwargs["json"] = body
        async with self.http.request(method, (base or self.url) + path, **kwargs) as r:
            raw = await r.read()
            try:
                parsed: Any = orjson.loads(raw)
            except orjson.JSONDecodeError:
                parsed = raw.decode("utf-8", "replace")
            return r.status, parsed, CIMultiDict(r.headers)

    async def reservations(self) -> int:
        return await self.router.gate.store.count()

    def published(self, topic: str) -> list[bytes]:
        """Values the router queued for ``topic`` (its Kafka bus is not running)."""
        name = f"{self.router.bus.settings.namespace}.{topic}"
        return [v for t, _, v in self.router.bus._outbox if t == name and v is not None]

    def decisions(self) -> list[Decision]:
        return [decode(Decision, v) for v in self.published(DECISIONS.suffix)]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


@dataclass
class Seen:
    """What a recording engine received: each request's headers and JSON body."""

    headers: list[CIMultiDict[str]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)


@contextlib.asynccontextmanager
async def recording_engine() -> AsyncIterator[tuple[str, Seen]]:
    """A stand-in engine at the URL it yields: every ``POST /v1/completions`` gets a one-token
    answer, and what it received is kept (point an edge's nodes at it: ``e.engines[n] = url``)."""
    seen = Seen()

    async def engine(request: web.Request) -> web.Response:
        seen.headers.append(CIMultiDict(request.headers))
        seen.bodies.append(await request.json())
        body = {
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1},
        }
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/v1/completions", engine)
    runner, url = await _serve(app)
    try:
        yield url, seen
    finally:
        await runner.cleanup()


def _beat(node: str, url: str, blocks: int, seq: int) -> Heartbeat:
    return Heartbeat(
        node_id=node,
        epoch="e1",
        seq=seq,
        ts=time.time(),
        endpoint=url,
        model=MODEL,
        block_size=16,
        kv_blocks_total=blocks,
        kv_blocks_used=0,
        running=0,
        waiting=0,
    )


@contextlib.asynccontextmanager
async def edge(
    engines: int = 2,
    blocks: int = 2000,
    router: dict[str, Any] | None = None,
    admission: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    tracing: Tracing | None = None,
    profile: dict[str, Any] | None = None,
) -> AsyncIterator[Edge]:
    """A router (main listener + admin listener on loopback) in front of ``engines`` simulated
    engines of ``blocks`` KV blocks each. Defaults: admin and two gateway keys, two tenants;
    ``tracing``: the router's (off by default); ``profile``: the engines' profile fields."""
    runners: dict[str, web.AppRunner] = {}
    sims: dict[str, SimEngine] = {}
    urls: dict[str, str] = {}
    for i in range(engines):
        es = EngineSettings(
            kv_events_endpoint=None,
            profile=EngineProfile(num_gpu_blocks_override=blocks, **(profile or {})),
            **(engine or {}),
        )
        sim = SimEngine(es)
        runner, url = await _serve(sim.app())
        sims[f"n{i + 1}"] = sim
        runners[f"n{i + 1}"] = runner
        urls[f"n{i + 1}"] = url
    rs = RouterSettings(
        **{
            "port": 0,
            "admin_port": 0,
            "admin_keys": {ADMIN: "ops"},
            "gateway_keys": {GATEWAY: "gw-a", OTHER_GATEWAY: "gw-b"},
            "prewarm": True,
            **(router or {}),
        }
    )
    adm = AdmissionSettings(**{"tenants": TENANTS, **(admission or {})})
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:1", namespace=f"t{uuid.uuid4().hex[:8]}")
    replica = TableReplica(kafka, WorkerSettings(), "edge-replica")
    bus = KafkaBus(kafka, "edge")
    router = build_router(rs, replica, bus, make_policy(rs), adm, tracing=tracing)
    e: Edge | None = None

    async def feed() -> None:
        seq = 0
        while True:
            if e is not None and e.feeding:
                seq += 1
                now = time.time()
                for node, url in urls.items():
                    hb = _beat(node, url, blocks, seq)
                    if node in e.overrides:
                        hb = hb.model_copy(update=e.overrides[node])
                    replica.load[node] = hb
                    replica.received[node] = now
                    e.beats[node] = hb
                replica.last_heartbeat_rx = now
            await asyncio.sleep(0.2)

    listeners = await start_listeners(router.app, router.admin, rs)
    ports = listeners.ports
    http = aiohttp.ClientSession()
    e = Edge(
        router,
        f"http://127.0.0.1:{ports[0]}",
        f"http://127.0.0.1:{ports[1]}" if len(ports) > 1 else None,
        urls,  # what the heartbeats announce: point a node elsewhere to take its engine away
        listeners,
        http,
        runners=runners,
        sims=sims,
    )
    feeder = asyncio.create_task(feed())
    await asyncio.sleep(0.05)
    replica.caught_up.set()
    try:
        yield e
    finally:
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeder
        await http.close()
        await listeners.stop()
        for runner in e.runners.values():
            await runner.cleanup()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(prompt: str = "hello " * 40, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}


async def raw_http(port: int, payload: bytes, read_timeout_s: float = 5.0) -> bytes:
    """Send raw bytes to a listener and read what comes back until it closes (or times out)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        out = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            async with asyncio.timeout(read_timeout_s):
                while chunk := await reader.read(65536):
                    out += chunk
        return out
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
