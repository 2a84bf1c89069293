"""A small live cluster for integration tests: engines + agents, a Faust worker, routers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import orjson
from pydantic import BaseModel

from deploy.procs import Supervisor, free_port
from streams.codec import decode
from streams.kafka import make_consumer
from streams.schemas import Decision
from streams.settings import KafkaSettings
from streams.topics import DECISIONS, TopicSpec
from tests.conftest import wait_until

M = TypeVar("M", bound=BaseModel)

MODEL = "llama-3.1-8b"
ADMIN_KEY = "kvgate-test-admin"
GATEWAY_KEY = "kvgate-test-gateway"
# the routers of these tests accept one admin and one gateway key (router.admin_keys,
# router.gateway_keys); ``post`` and ``get`` present them on the endpoints that need them
ROUTER_KEYS = {
    "KVGATE_ROUTER__ADMIN_KEYS": f'{{"{ADMIN_KEY}": "tests"}}',
    "KVGATE_ROUTER__GATEWAY_KEYS": f'{{"{GATEWAY_KEY}": "test-gateway"}}',
}
_ADMIN_PATHS = ("/v1/kvgate/decide", "/v1/kvgate/state")
_GATEWAY_PATHS = ("/v1/kvgate/route", "/v1/kvgate/release", "/v1/kvgate/renew")


def credentials(path: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    """``headers`` plus the admin or gateway key the path needs (unless already given)."""
    out = dict(headers or {})
    path = path.split("?", 1)[0]
    if path in _ADMIN_PATHS:
        out.setdefault("Authorization", f"Bearer {ADMIN_KEY}")
    elif path in _GATEWAY_PATHS:
        out.setdefault("X-Kvgate-Gateway-Key", GATEWAY_KEY)
    return out


@dataclass
class Cluster:
    sup: Supervisor
    engines: dict[str, str] = field(default_factory=dict)  # node id -> engine URL
    routers: dict[str, str] = field(default_factory=dict)  # name -> router URL

    def add_engine(
        self,
        node_id: str,
        num_gpu_blocks: int = 2000,
        sglang: bool = False,
        model: str | None = None,
        engine_env: dict[str, str] | None = None,
        agent_env: dict[str, str] | None = None,
    ) -> str:
        url = self.sup.spawn_node(node_id, num_gpu_blocks, sglang, model, engine_env, agent_env)
        self.engines[node_id] = url
        return url

    def add_agent(self, node_id: str, engine_url: str, *kv_events: str) -> None:
        """An agent of one's own for ``node_id`` (its KV-event arguments as given), in place of
        the one :meth:`add_engine` started."""
        if f"agent-{node_id}" in self.sup.procs:
            self.sup.kill(f"agent-{node_id}")
        self.sup.spawn(
            f"agent-{node_id}",
            "agent",
            "--node-id",
            node_id,
            "--engine-url",
            engine_url,
            *kv_events,
        )

    def add_worker(self, name: str = "worker") -> None:
        self.sup.spawn(name, "worker")

    def add_router(self, name: str = "router", env: dict[str, str] | None = None) -> str:
        port = free_port()
        self.sup.spawn(
            name,
            "router",
            "--port",
            str(port),
            env={"KVGATE_ROUTER__ROUTER_ID": name, **ROUTER_KEYS, **(env or {})},
        )
        url = f"http://127.0.0.1:{port}"
        self.routers[name] = url
        return url

    @classmethod
    async def started(
        cls, sup: Supervisor, engines: dict[str, dict[str, Any]], router: str = "router"
    ) -> tuple[Cluster, str]:
        """Engines (node id -> add_engine options) with agents, a worker and a ready router."""
        c = cls(sup)
        for node_id, options in engines.items():
            c.add_engine(node_id, **options)
        c.add_worker()
        url = c.add_router(router)
        await c.wait_ready(router, len(engines))
        return c, url

    @classmethod
    async def two_nodes(cls, sup: Supervisor, router: str = "router") -> tuple[Cluster, str]:
        """Engines n1 and n2 with agents, a worker and a ready router."""
        return await cls.started(sup, {"n1": {}, "n2": {}}, router)

    async def wait_ready(self, router: str, nodes: int, timeout_s: float = 90.0) -> None:
        url = self.routers[router]

        async def ready() -> bool:
            async with aiohttp.ClientSession() as http, http.get(url + "/ready") as r:
                body = await r.json()
                return bool(body["ready"]) and body["healthy_nodes"] >= nodes

        await wait_until(ready, timeout_s, f"{router} ready with {nodes} nodes", 0.25)


async def post(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, json=body, headers=credentials(path, headers)) as r,
    ):
        if r.content_type == "text/event-stream":
            return r.status, await r.text()
        return r.status, await r.json(content_type=None)


async def metric(url: str, name: str) -> float:
    """The sum of the samples of ``url``'s /metrics whose line starts with ``name``."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def get(url: str, path: str) -> Any:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url + path, headers=credentials(path)) as r,
    ):
        return await r.json(content_type=None)


async def ledger_open(*urls: str) -> int | None:
    """Open reservations on the ledger, as the routers at ``urls`` that follow it (the one
    reconciling, and any standing by) fold it; None when none of them follows it."""
    counts = [(await get(u, "/v1/kvgate/state"))["reconciler"]["ledger_open"] for u in urls]
    known = [c for c in counts if c is not None]
    return max(known) if known else None


def kvgate_cli(supervisor: Supervisor, *argv: str) -> subprocess.CompletedProcess[str]:
    """``kvgate ARGV`` with the cluster's environment (its Kafka, its keys)."""
    return subprocess.run(
        [sys.executable, "-m", "deploy", *argv],
        env={**os.environ, **supervisor.env},
        capture_output=True,
        text=True,
        timeout=60,
    )


async def streamed_completion(
    url: str, prompt: str | list[int], rid: str, max_tokens: int = 8
) -> tuple[str, dict[str, Any]]:
    """A streamed completion through the router at ``url``: the node that answered and the
    usage of its last chunk (the stream must end with ``[DONE]``)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict[str, Any] = {}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r,
    ):
        assert r.status == 200, await r.text()
        node = r.headers["X-Kvgate-Node"]
        text = await r.text()
    assert text.rstrip().endswith("data: [DONE]")
    for line in text.splitlines():
        if line.startswith("data: {"):
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
    return node, usage


def long_prompt(tag: str, words: int = 200) -> str:
    return f"[{tag}] " + " ".join(f"word{i % 37}" for i in range(words))


async def read_topic(
    kafka: KafkaSettings,
    spec: TopicSpec,
    model: type[M],
    done: Callable[[list[M]], bool],
    timeout_s: float = 30.0,
) -> list[M]:
    """Read ``spec``'s topic from the beginning until ``done`` holds for what was read."""
    consumer = make_consumer(
        kafka, spec.name(kafka.namespace), group_id=None, client_id=f"t-{spec.name('t')}"
    )
    await consumer.start()
    out: list[M] = []
    try:
        deadline = time.monotonic() + timeout_s
        while not done(out) and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                out += [decode(model, r.value) for r in records if r.value is not None]
    finally:
        await consumer.stop()
    return out


async def decision_of(kafka: KafkaSettings, client_request_id: str) -> Decision:
    """The decision record of the request the client sent as ``client_request_id``."""
    decisions = await read_topic(
        kafka,
        DECISIONS,
        Decision,
        lambda ds: client_request_id in {d.client_request_id for d in ds},
    )
    return next(d for d in decisions if d.client_request_id == client_request_id)
