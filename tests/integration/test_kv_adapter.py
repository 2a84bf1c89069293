"""The vLLM KV-event adapter on real sockets and a real pipeline: a sequence gap is filled from
the engine's replay socket (vLLM's protocol, spoken here by raw ZeroMQ sockets); AllBlocksCleared
and an engine restart take the node's blocks out of the index."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from agents.kvcache import BlockStored
from agents.vllm_events import KvEventSubscriber, encode_batch
from deploy.procs import Supervisor, free_port
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, get, long_prompt, post

pytestmark = pytest.mark.integration


def _batch(i: int) -> bytes:
    return encode_batch([BlockStored((1000 + i,), None, tuple(range(16 * i, 16 * i + 16)))], 16)


async def _engine_side(
    drop: set[int], replay: bool, sends: list[int]
) -> tuple[list[tuple[int, bool]], KvEventSubscriber]:
    """Publish batches ``sends`` (in that order) like vLLM, leaving out ``drop`` on PUB but
    keeping them for replay; collect what the subscriber yields."""
    ctx = zmq.asyncio.Context()
    pub_url, replay_url = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = ctx.socket(zmq.PUB)
    pub.bind(pub_url)
    router = ctx.socket(zmq.ROUTER)
    router.bind(replay_url)
    buffer = {i: _batch(i) for i in sends}
    sub = KvEventSubscriber(pub_url, replay_url if replay else None, replay_timeout_s=0.5)
    got: list[tuple[int, bool]] = []

    async def consume() -> None:
        async for seq, _, restarted in sub.batches():
            got.append((seq, restarted))

    async def serve_replay() -> None:  # vLLM's replay service: from a start seq, then END
        while True:
            ident, _, start = await router.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            for seq in sorted(s for s in buffer if s >= first):
                await router.send_multipart(
                    [ident, b"", seq.to_bytes(8, "big", signed=True), buffer[seq]]
                )
            await router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    tasks = [asyncio.create_task(consume()), asyncio.create_task(serve_replay())]
    try:
        await asyncio.sleep(0.3)  # the SUB's subscription reaches the PUB
        for seq in sends:
            if seq not in drop:
                await pub.send_multipart(
                    [b"kv-events", seq.to_bytes(8, "big", signed=True), buffer[seq]]
                )
            await asyncio.sleep(0.02)
        expect = len([s for s in sends if s not in drop]) + (len(drop) if replay else 0)
        await wait_until(lambda: _true(len(got) >= expect), 5, "the batches", 0.02)
        await asyncio.sleep(0.2)
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()
    return got, sub


async def _true(v: bool) -> bool:
    return v


async def test_a_sequence_gap_is_filled_from_the_replay_socket() -> None:
    got, sub = await _engine_side(drop={1, 2}, replay=True, sends=[0, 1, 2, 3, 4])
    assert [s for s, _ in got] == [0, 1, 2, 3, 4]  # in order, nothing lost
    assert sub.gaps == 1 and sub.recovered == 2 and sub.lost == 0


async def test_without_replay_a_gap_is_counted_as_lost() -> None:
    got, sub = await _engine_side(drop={1, 2}, replay=False, sends=[0, 1, 2, 3])
    assert [s for s, _ in got] == [0, 3]
    assert sub.gaps == 1 and sub.lost == 2


async def test_a_sequence_going_back_is_an_engine_restart() -> None:
    got, _ = await _engine_side(drop=set(), replay=True, sends=[5, 6, 0])
    assert got == [(5, False), (6, False), (0, True)]


async def test_cleared_cache_and_restarted_engine_leave_the_index(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    c, router = await Cluster.started(supervisor, {"n1": {}})
    engine = c.engines["n1"]

    async def indexed() -> int:
        s: dict[str, Any] = await get(router, "/v1/kvgate/state")
        return int(s["nodes"]["n1"]["indexed_blocks"]) if "n1" in s["nodes"] else -1

    async def serve_one(tag: str) -> None:
        status, _ = await post(
            router, "/v1/completions", {"model": MODEL, "prompt": long_prompt(tag), "max_tokens": 2}
        )
        assert status == 200
        await wait_until(lambda: _positive(indexed()), 10, "blocks in the index", 0.1)

    # AllBlocksCleared (vLLM's /reset_prefix_cache) empties the node's entries
    await serve_one("a")
    status, body = await post(engine, "/reset_prefix_cache", {})
    assert status == 200 and body == {"reset": True}
    await wait_until(lambda: _zero(indexed()), 10, "the cleared blocks to leave the index", 0.1)

    # a restarted engine's blocks are gone with it: the index forgets them
    await serve_one("b")
    proc = supervisor.procs["engine-n1"]
    argv = list(proc.popen.args)  # type: ignore[arg-type]
    supervisor.kill("engine-n1", 9)
    supervisor.spawn_argv("engine-n1", argv)  # same ports, empty cache
    await wait_until(lambda: _zero(indexed()), 15, "the restarted engine's stale blocks to go", 0.1)

    # the agent reports the restart in its heartbeats; the router shows it
    async def restart_reported() -> bool:
        s: dict[str, Any] = await get(router, "/v1/kvgate/state")
        return bool(s["nodes"]["n1"]["engine_restarts"] >= 1)

    await wait_until(restart_reported, 10, "the engine restart in the router's state", 0.1)
    async with aiohttp.ClientSession() as http, http.get(router + "/metrics") as r:
        metrics = await r.text()
    assert "kvgate_router_engine_restarts 1.0" in metrics, metrics
    assert "kvgate_router_kv_events_lost 0.0" in metrics


async def _positive(v: Any) -> bool:
    return int(await v) > 0


async def _zero(v: Any) -> bool:
    return int(await v) == 0


async def test_engines_of_both_event_shapes_are_indexed(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    """One engine writes vLLM >= 0.26's map events, the other the legacy arrays: the same
    agent indexes both, and nothing is undecodable or dropped."""
    await ensure_topics(kafka_settings)
    c, router = await Cluster.started(
        supervisor,
        {"n1": {}, "n2": {"engine_env": {"KVGATE_ENGINE__KV_EVENTS_SHAPE": "array"}}},
    )
    for node in ("n1", "n2"):  # each engine computes a prompt of its own
        body = {"model": MODEL, "prompt": long_prompt(f"shape-{node}"), "max_tokens": 2}
        status, _ = await post(c.engines[node], "/v1/completions", body)
        assert status == 200

    async def indexed() -> bool:
        s: dict[str, Any] = await get(router, "/v1/kvgate/state")
        return all(s["nodes"][n]["indexed_blocks"] > 0 for n in ("n1", "n2"))

    await wait_until(indexed, 20, "both nodes indexed", 0.2)
    state: dict[str, Any] = await get(router, "/v1/kvgate/state")
    for node in ("n1", "n2"):
        counters = state["nodes"][node]
        assert counters["kv_events_undecodable"] == 0, counters
        assert counters["kv_blocks_untranslatable"] == 0 and counters["kv_blocks_skipped"] == 0


async def test_an_agent_whose_events_go_nowhere_says_so(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    """The engine prefills, but the agent listens where nothing publishes: within
    agent.kv_silence_s its heartbeats say ``kv_index: degraded`` and routers treat the node as
    approximate (their own memory of what they sent it) instead of trusting an empty index."""
    await ensure_topics(kafka_settings)
    supervisor.env["KVGATE_AGENT__KV_SILENCE_S"] = "2"
    c = Cluster(supervisor)
    url = c.add_engine("n1")
    c.add_agent("n1", url, "--kv-events", f"tcp://127.0.0.1:{free_port()}")  # nobody publishes
    c.add_worker()
    router = c.add_router()
    await c.wait_ready("router", 1)
    for i in range(3):
        body = {"model": MODEL, "prompt": long_prompt(f"silent-{i}"), "max_tokens": 2}
        status, _ = await post(url, "/v1/completions", body)
        assert status == 200

    async def degraded() -> bool:
        s: dict[str, Any] = await get(router, "/v1/kvgate/state")
        return bool(s["nodes"]["n1"]["kv_index"] == "degraded")

    await wait_until(degraded, 20, "the heartbeat says degraded", 0.25)
    body = {"model": MODEL, "prompt": long_prompt("silent-0"), "max_tokens": 2}
    status, _ = await post(router, "/v1/completions", body)
    assert status == 200
    status, d = await post(router, "/v1/kvgate/decide", body)
    assert status == 200 and d["candidates"][0]["hit_blocks"] > 0  # the router's own memory


async def test_an_engine_that_dials_out_to_its_agent_is_indexed(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    """Collector style (llm-d): the agent binds the KV-event endpoint, the engine connects."""
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    port, http_port = free_port(), free_port()
    supervisor.spawn(
        "engine-n1",
        "engine",
        "--port",
        str(http_port),
        "--kv-events-port",
        str(port),
        "--kv-events-connect",
    )
    url = f"http://127.0.0.1:{http_port}"
    c.add_agent("n1", url, "--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-bind")
    c.add_worker()
    router = c.add_router()
    await c.wait_ready("router", 1)
    body = {"model": MODEL, "prompt": long_prompt("dial-out"), "max_tokens": 2}
    status, _ = await post(url, "/v1/completions", body)
    assert status == 200

    async def indexed() -> bool:
        s: dict[str, Any] = await get(router, "/v1/kvgate/state")
        return bool(s["nodes"]["n1"]["indexed_blocks"] > 0)

    await wait_until(indexed, 20, "the dialling engine's blocks indexed", 0.2)
    state: dict[str, Any] = await get(router, "/v1/kvgate/state")
    assert state["nodes"]["n1"]["kv_index"] == "events"
