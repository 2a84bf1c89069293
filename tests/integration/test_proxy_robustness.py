"""The proxy under real streaming traffic: clients that leave mid-stream leave nothing behind
(no reservation held, no request running in an engine), and an engine killed mid-stream costs
its clients nothing: their streams go on from another node, whole, while the router carries on
(a stream that cannot be continued ends with a clean SSE error event: tests/edge)."""

from __future__ import annotations

import asyncio
import random
import re
import signal
from collections.abc import Awaitable

import aiohttp
import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, get, metric, post

pytestmark = [pytest.mark.integration, pytest.mark.fault]

_GAUGE = re.compile(rb"^vllm:num_requests_(running|waiting)\{[^}]*\} ([0-9.]+)$", re.M)


async def streamed(
    http: aiohttp.ClientSession, router: str, prompt: str, tokens: int, began: asyncio.Event
) -> tuple[str, int, int]:
    """A streamed completion read to its end: the node that first served it, the text chunks
    received and the error events among them (``began`` is set at the first byte)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True}
    async with http.post(router + "/v1/completions", json=body) as r:
        node, pieces, errors = r.headers["X-Kvgate-Node"], 0, 0
        async for line in r.content:
            began.set()
            if line.startswith(b"data: {"):
                errors += b'"error"' in line
                pieces += b'"text":"' in line and b'"text":""' not in line
        return node, pieces, errors


async def engine_requests(url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        return sum(float(v) for _, v in _GAUGE.findall(await r.read()))


async def test_clients_leaving_mid_stream_leave_no_reservation_and_no_engine_work(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    c, router = await Cluster.two_nodes(supervisor)
    rng = random.Random(7)
    outcomes = {"completed": 0, "left": 0}

    async def client(http: aiohttp.ClientSession, i: int) -> None:
        leave_after = rng.choice([None, 0, 1, 3, 10])  # chunks read before leaving
        body = {
            "model": MODEL,
            "prompt": f"request {i}: " + "tell me a story " * rng.randint(5, 60),
            "max_tokens": rng.randint(20, 200),
            "stream": True,
        }
        async with http.post(router + "/v1/completions", json=body) as r:
            assert r.status == 200
            n = 0
            async for line in r.content:
                if line.startswith(b"data: "):
                    n += 1
                if leave_after is not None and n > leave_after:
                    r.close()  # the client goes away mid-stream
                    outcomes["left"] += 1
                    return
            outcomes["completed"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(client(http, i) for i in range(200)))
    assert outcomes["left"] > 50 and outcomes["completed"] > 20

    async def drained() -> bool:
        s = await get(router, "/v1/kvgate/state")
        running = sum([await engine_requests(url) for url in c.engines.values()])
        return s["reservations"] == 0 and s["inflight"] == 0 and running == 0

    await wait_until(drained, 15, "no reservation held and no engine request running", 0.2)


async def test_engine_killed_mid_stream_its_streams_go_on_from_the_other_node(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    _, router = await Cluster.two_nodes(supervisor)
    first_bytes = asyncio.Event()
    tokens = 600

    def client(http: aiohttp.ClientSession, i: int) -> Awaitable[tuple[str, int, int]]:
        prompt = f"client {i} " + "a long answer please " * 30
        return streamed(http, router, prompt, tokens, first_bytes)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        calls = [asyncio.create_task(client(http, i)) for i in range(12)]
        await asyncio.wait_for(first_bytes.wait(), 30)
        await asyncio.sleep(0.5)
        supervisor.kill("engine-n1", signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 120)

    on_dead = [r for r in results if not isinstance(r, BaseException) and r[0] == "n1"]
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert on_dead, "no stream was on the killed engine"
    for _, pieces, errors in results:  # every stream whole, none with an error event
        assert (pieces, errors) == (tokens, 0)
    resumed = await metric(router, 'kvgate_router_stream_resumes_total{result="resumed"}')
    assert resumed == len(on_dead)
    # the router carries on: healthy, serving, and nothing is held for the dead streams
    async with aiohttp.ClientSession() as http, http.get(router + "/health") as r:
        assert r.status == 200
    status, _ = await post(router, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert status == 200

    async def released() -> bool:
        s = await get(router, "/v1/kvgate/state")
        return s["reservations"] == 0 and s["inflight"] == 0

    await wait_until(released, 10, "the dead streams' reservations to be released", 0.2)


async def test_a_scale_down_moves_the_streams_before_the_engine_goes(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    """SIGTERM to a node's agent (its pod is being deleted): its heartbeats say draining for
    ``agent.drain_on_stop_s``, the router moves the node's streams after ``drain_grace_s`` to
    the other node — whole — and the engine runs nothing long before the streams end."""
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    for node in ("n1", "n2"):
        c.add_engine(node, agent_env={"KVGATE_AGENT__DRAIN_ON_STOP_S": "20"})
    c.add_worker()
    router = c.add_router(env={"KVGATE_ROUTER__DRAIN_GRACE_S": "1"})
    await c.wait_ready("router", 2)
    tokens = 1500  # ~13 s of an engine
    first_bytes = asyncio.Event()

    def client(http: aiohttp.ClientSession, i: int) -> Awaitable[tuple[str, int, int]]:
        return streamed(http, router, f"scale-down {i} " * 30, tokens, first_bytes)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        calls = [asyncio.create_task(client(http, i)) for i in range(8)]
        await asyncio.wait_for(first_bytes.wait(), 30)
        await asyncio.sleep(0.5)
        supervisor.procs["agent-n1"].popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        t0 = asyncio.get_running_loop().time()
        await wait_until(
            lambda: _idle(c.engines["n1"]),
            10,
            "n1 to run nothing",
            0.2,
        )
        moved_after = asyncio.get_running_loop().time() - t0
        results = await asyncio.wait_for(asyncio.gather(*calls), 120)
    assert moved_after < 6.0  # (its streams had ~10 s to go)
    assert any(node == "n1" for node, _, _ in results)
    for _, pieces, errors in results:
        assert (pieces, errors) == (tokens, 0)


async def _idle(url: str) -> bool:
    return await engine_requests(url) == 0
