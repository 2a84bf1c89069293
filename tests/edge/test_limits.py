"""Limits before work: authentication before the body, bounded bodies, header and body read
times, connections, stalled streams and long requests; every refusal in the OpenAI error shape
and no internal address in a 502."""

from __future__ import annotations

import asyncio
import socket

import orjson
import pytest

from admission.settings import Tenant
from tests.conftest import wait_until
from tests.edgekit import TENANTS, bearer, completion, edge, raw_http


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def _head(length: int, key: str | None = None, path: str = "/v1/completions") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


async def test_huge_bodies_are_refused_before_they_are_read() -> None:
    """64 MiB announced: without a key → 401, with one → 413; neither waits for the body
    (none is sent). Sent chunked past the limit → 413 after the limit, not after 64 MiB."""
    async with edge(admission={"require_api_key": True}, router={"max_body_bytes": 1 << 20}) as e:
        port = _port(e.url)
        answer = await raw_http(port, _head(64 << 20), read_timeout_s=5)
        assert _status(answer) == 401 and b'"unauthorized"' in answer
        answer = await raw_http(port, _head(64 << 20, "sk-alpha"), read_timeout_s=5)
        assert _status(answer) == 413 and b"over the limit" in answer

        async def chunks() -> object:
            for _ in range(64):
                yield b"x" * (1 << 20)

        async with e.http.post(
            e.url + "/v1/completions", data=chunks(), headers=bearer("sk-alpha")
        ) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == 413
        assert await e.reservations() == 0


async def test_slow_bodies_get_408_and_slow_headers_are_cut() -> None:
    async with edge(router={"body_timeout_s": 0.5, "idle_timeout_s": 1.0}) as e:
        port = _port(e.url)
        # the body never completes
        answer = await raw_http(port, _head(100) + b'{"model": "x"', read_timeout_s=5)
        assert _status(answer) == 408 and b"not received within" in answer
        # headers that never complete: the connection is closed after idle_timeout_s
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        await writer.drain()
        got = await asyncio.wait_for(reader.read(), timeout=10)  # EOF: the router closed it
        assert got == b"" or _status(got) >= 400
        writer.close()
        # an idle connection that never sends anything is closed as well
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), timeout=10) == b""
        writer.close()
        assert await e.reservations() == 0


async def test_connections_over_the_limit_get_503() -> None:
    async with edge(router={"max_connections": 3, "idle_timeout_s": 30.0}) as e:
        port = _port(e.url)
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await asyncio.sleep(0.1)
        answer = await raw_http(port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n", 5)
        assert _status(answer) == 503 and b"too many open connections" in answer
        assert b"Retry-After: 1" in answer
        for _, w in held:
            w.close()
        await asyncio.sleep(0.2)
        status, _, _ = await e.call("GET", "/health")
        assert status == 200
        assert e.listeners.refused_connections == 1


async def test_a_client_that_stops_reading_loses_its_reservation() -> None:
    """A streaming client that never reads: the router cuts it off after
    stream_write_timeout_s once the socket buffers are full, and releases its reservation."""
    async with edge(router={"stream_write_timeout_s": 0.5}, engines=1) as e:
        body = orjson.dumps(completion("story " * 50, max_tokens=20000, stream=True))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", _port(e.url)))
        sock.send(_head(len(body)).replace(b"Connection: close", b"Connection: keep-alive") + body)

        async def reserved() -> bool:
            return await e.reservations() == 1

        await wait_until(reserved, 5, "the stream admitted")

        async def released() -> bool:
            return await e.reservations() == 0

        await wait_until(released, 60, "the stalled stream released", 0.25)
        metrics = (await e.call("GET", "/metrics"))[1]
        assert "kvgate_router_stalled_clients_total 1.0" in metrics
        sock.close()


async def test_no_request_runs_past_max_stream_s() -> None:
    async with edge(router={"max_stream_s": 1.0}, engines=1) as e:
        body = completion("story " * 50, max_tokens=20000, stream=True)
        async with e.http.post(e.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            text = (await r.read()).decode()
        assert "max_duration_s" in text and text.rstrip().endswith("data: [DONE]")
        tokens = sum(1 for line in text.splitlines() if '"text"' in line)
        assert 0 < tokens < 20000  # cut off: the engine was not left to finish
        assert await e.reservations() == 0


async def test_errors_have_the_openai_shape_and_hide_addresses() -> None:
    async with edge(engines=1) as e:
        for method, path in (("GET", "/nope"), ("PUT", "/v1/completions")):
            status, out, _ = await e.call(method, path)
            assert status in (404, 405) and out["error"]["code"] == status, out
        status, out, _ = await e.call("POST", "/v1/completions", data=b"{not json")
        assert status == 400 and "invalid JSON" in out["error"]["message"]
        # the engine goes away, its heartbeats do not (yet): a 502 that names no address
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
        e.engines["n1"] = dead  # the feeder announces it from now on
        await asyncio.sleep(0.5)
        status, out, _ = await e.call("POST", "/v1/completions", completion())
        assert status == 502 and out["error"]["code"] == 502
        assert "127.0.0.1" not in str(out) and dead not in str(out)
        assert await e.reservations() == 0


async def test_clients_cannot_send_kv_transfer_params() -> None:
    """An engine with a KV connector pulls KV from wherever kv_transfer_params say: a client's
    are refused (400), on every route, before anything reaches an engine."""
    hostile = {"do_remote_prefill": True, "remote_host": "10.0.0.66", "remote_port": 5600}
    async with edge() as e:
        for path in ("/v1/completions", "/v1/chat/completions"):
            body = completion(kv_transfer_params=hostile)
            if path.endswith("chat/completions"):
                body = {"model": body["model"], "messages": [{"role": "user", "content": "hi"}]}
                body["kv_transfer_params"] = hostile
            status, out, _ = await e.call("POST", path, body, bearer("sk-alpha"))
            assert status == 400 and "kv_transfer_params" in out["error"]["message"], out
        assert not e.decisions() or all(d.chosen_node is None for d in e.decisions())


async def _request_from(host: str, port: int, payload: bytes) -> bytes:
    """``payload`` sent from local address ``host``; what comes back until the router closes
    (a reset mid-way raises: the answer must arrive whole)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
    try:
        writer.write(payload)
        await writer.drain()
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.close()


async def test_one_client_cannot_hold_the_listener() -> None:
    """One address holding its share of connections gets a 503 for the next (whole, read after
    its request was sent: no reset); another address, and a probe past the cap, still get in."""
    limits = {"max_connections": 6, "max_connections_per_client": 4, "idle_timeout_s": 30.0}
    async with edge(router=limits) as e:
        port = _port(e.url)
        held = [
            await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
            for _ in range(4)
        ]
        await asyncio.sleep(0.1)
        health = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        for _ in range(3):  # the answer survives the request the client sends after it
            answer = await _request_from("127.0.0.2", port, health + b"x" * 4096)
            assert _status(answer) == 503 and b"too many open connections" in answer, answer
        assert _status(await _request_from("127.0.0.3", port, health)) == 200
        # the listener full (two more clients): a client already holding one is refused, a
        # client holding none (a liveness probe) still gets in
        more = [
            await asyncio.open_connection("127.0.0.1", port, local_addr=(f"127.0.0.{i}", 0))
            for i in (4, 5)
        ]
        await asyncio.sleep(0.1)
        assert _status(await _request_from("127.0.0.4", port, health)) == 503
        assert _status(await _request_from("127.0.0.6", port, health)) == 200
        for _, w in held + more:
            w.close()
        assert e.listeners.refused_connections == 4


async def test_a_network_can_be_exempt_from_the_share() -> None:
    limits = {
        "max_connections_per_client": 1,
        "connection_share_exempt": ["127.0.0.8/30"],
        "idle_timeout_s": 30.0,
    }
    async with edge(router=limits) as e:
        port = _port(e.url)
        held = [
            await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
            for host in ("127.0.0.8", "127.0.0.12")
        ]
        await asyncio.sleep(0.1)
        health = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        assert _status(await _request_from("127.0.0.8", port, health)) == 200  # an ingress
        assert _status(await _request_from("127.0.0.12", port, health)) == 503
        for _, w in held:
            w.close()


def test_the_connection_limits_hold_on_uvloop() -> None:
    """The router runs on uvloop by default, whose transports are not asyncio's classes: the
    503 must arrive whole there too."""
    uvloop = pytest.importorskip("uvloop")

    async def both() -> None:
        await test_connections_over_the_limit_get_503()
        await test_one_client_cannot_hold_the_listener()

    uvloop.run(both())


async def test_stalled_streams_are_cut_within_the_stall_budget_while_others_wait() -> None:
    """Two streams whose clients stop reading hold most of the KV budget. Nobody else waiting,
    they keep it (only the write timeout cuts them); once a low-priority tenant is refused for
    KV, they are cut within the stall budget, their reservations released, and the tenant gets
    in."""
    tenants = {**TENANTS, "sk-low": Tenant(name="low", priority="low")}
    async with edge(
        engines=1,
        blocks=2000,
        router={"stall_budget_s": 1.0, "stream_write_timeout_s": 60.0},
        admission={"tenants": tenants},
        profile={"step_base_s": 0.004},  # fast decoding: the buffers fill in a few seconds
    ) as e:
        port = _port(e.url)
        # each ~825 of the 2,000 blocks (prompt and output): both past the yellow watermark
        body = orjson.dumps(completion("story " * 7466, max_tokens=2000, stream=True))
        socks = []
        for _ in range(2):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            head = _head(len(body), "sk-alpha").replace(b"Connection: close", b"Connection: x")
            await asyncio.get_running_loop().sock_sendall(sock, head + body)
            socks.append(sock)

        async def both_reserved() -> bool:
            return await e.reservations() == 2

        await wait_until(both_reserved, 5, "both streams admitted")
        await asyncio.sleep(6)  # stalled well past the budget: nobody waits, they stay
        assert await e.reservations() == 2
        low = completion("a short question", max_tokens=8)
        status, out, _ = await e.call("POST", "/v1/completions", low, bearer("sk-low"))
        assert status == 429 and out["error"]["type"] == "yellow_low_priority", out

        async def released() -> bool:
            return await e.reservations() == 0

        # each cut once it has stalled for the budget (1 s), long before the 60 s timeout
        await wait_until(released, 20, "the stalled streams cut", 0.1)
        # a new request (the refused one is held to its Retry-After)
        again = completion("another short question", max_tokens=8)
        status, out, _ = await e.call("POST", "/v1/completions", again, bearer("sk-low"))
        assert status == 200, out
        metrics = (await e.call("GET", "/metrics"))[1]
        assert "kvgate_router_stalled_clients_total 2.0" in metrics
        for sock in socks:
            sock.close()
