"""kvgate's wire layer (router/wire) against another HTTP implementation: its server spoken to
by aiohttp's client and by raw sockets, its client speaking to an aiohttp server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web

from router.wire.client import Pool, UpstreamError
from router.wire.server import Headers, Limits, Refused, Reply, Request, serve


async def _handler(request: Request, reply: Reply) -> None:
    if request.path == "/echo":
        reply.json(
            200,
            {
                "method": request.method,
                "body": request.body.decode(),
                "query": request.query,
                "x": request.headers.get("x-thing"),
                "screened": request.screened,
            },
        )
    elif request.path == "/stream":
        reply.start(200, "text/event-stream")
        for i in range(3):
            await reply.write(b"data: %d\n\n" % i)
        reply.end()
    elif request.path == "/slow-stream":
        reply.start(200, "text/event-stream")
        while True:
            await reply.write(b"x" * 65536)
    elif request.path == "/boom":
        raise RuntimeError("a bug")
    else:
        reply.json(404, {"error": "no"})


async def _server(limits: Limits | None = None) -> tuple[asyncio.Server, str]:
    server = await serve(_handler, "127.0.0.1", 0, limits)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def test_the_server_answers_aiohttps_client_kept_alive_and_streamed() -> None:
    server, url = await _server()
    async with server, aiohttp.ClientSession() as http:
        for _ in range(3):  # one kept-alive connection
            async with http.post(url + "/echo?a=1", data=b"hello", headers={"X-Thing": "y"}) as r:
                assert r.status == 200
                assert await r.json() == {
                    "method": "POST",
                    "body": "hello",
                    "query": "a=1",
                    "x": "y",
                    "screened": None,
                }
        async with http.get(url + "/stream") as r:
            assert r.headers["Transfer-Encoding"] == "chunked"
            assert await r.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        async with http.get(url + "/boom") as r:
            assert r.status == 500
        async with http.get(url + "/nothing") as r:
            assert r.status == 404


async def _raw(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(1 << 20), 5)
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GARBAGE\r\n\r\n", b"400"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", b"413"),
        (
            b"GET /echo HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(200)) + b"\r\n",
            b"431",
        ),
        (b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\n\r\n", b"414"),
    ],
)
async def test_bad_requests_get_a_status_and_the_connection_closes(
    raw: bytes, status: bytes
) -> None:
    server, url = await _server(Limits(max_body=1 << 20))
    async with server:
        answer = await _raw(url, raw)
    assert answer.split(b" ")[1] == status, answer[:200]
    assert b"Connection: close" in answer


async def test_an_upgrade_is_ignored_the_request_answered_and_the_connection_closed() -> None:
    server, url = await _server()
    async with server:
        answer = await _raw(
            url, b"GET /echo HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n\x81\x00"
        )
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1


async def _to_the_end(url: str, data: bytes, half_close: bool = False) -> bytes:
    """Send ``data`` (then, ``half_close``, the end of the client's side) and read what comes
    back until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    if half_close:
        writer.write_eof()
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def test_a_half_closed_client_gets_its_answer_and_the_connection_closes() -> None:
    server, url = await _server()
    async with server:
        answer = await _to_the_end(url, b"GET /stream HTTP/1.1\r\n\r\n", half_close=True)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"0\r\n\r\n")


async def test_pipelined_requests_are_answered_in_order() -> None:
    server, url = await _server()
    two = (
        b"POST /echo HTTP/1.1\r\nContent-Length: 1\r\n\r\na"
        b"POST /echo HTTP/1.1\r\nContent-Length: 1\r\nConnection: close\r\n\r\nb"
    )
    async with server:
        answer = await _raw(url, two)
    assert answer.count(b"HTTP/1.1 200") == 2
    assert answer.index(b'"body":"a"') < answer.index(b'"body":"b"')


async def test_a_request_that_does_not_arrive_in_time_is_a_408() -> None:
    server, url = await _server(Limits(body_timeout_s=0.2, idle_timeout_s=0.2))
    async with server:
        answer = await _raw(url, b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
    assert answer.startswith(b"HTTP/1.1 408")


async def test_a_client_gone_mid_stream_ends_the_handler() -> None:
    ended = asyncio.Event()

    async def handler(request: Request, reply: Reply) -> None:
        try:
            await _handler(request, reply)
        finally:
            ended.set()

    server = await serve(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow-stream HTTP/1.1\r\n\r\n")
        await reader.read(1000)
        writer.transport.abort()  # the client goes away without reading the rest
        await asyncio.wait_for(ended.wait(), 5)


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    """An aiohttp server standing for an engine: a JSON echo and an SSE stream."""

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {"got": (await request.read()).decode(), "ctype": request.headers.get("Content-Type")}
        )

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        for i in range(5):
            await resp.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def drop(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()
        return web.Response()

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/stream", stream)
    app.router.add_post("/drop", drop)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"127.0.0.1:{port}"
    await runner.cleanup()


async def test_the_client_speaks_to_an_aiohttp_server_and_keeps_its_connection(engine: str) -> None:
    host, port = engine.split(":")
    pool = Pool(host, int(port))
    for i in range(3):
        a = await pool.request("POST", "/echo", b"x%d" % i, (("Content-Type", "application/json"),))
        assert a.status == 200 and a.content_type == "application/json"
        assert (await a.read()) == b'{"got": "x%d", "ctype": "application/json"}' % i
    assert len(pool._free) == 1  # the one connection, kept
    a = await pool.request("POST", "/stream", b"{}")
    pieces = [c async for c in a.chunks()]
    assert b"".join(pieces) == b"".join(b"data: %d\n\n" % i for i in range(5))
    with pytest.raises(UpstreamError):
        await pool.request("POST", "/drop", b"{}")
    pool.close()


async def test_a_sink_takes_each_piece_as_it_arrives_and_hands_back_what_it_cannot(
    engine: str,
) -> None:
    """The relay's sink: pieces that arrive while the reader waits go to it from the
    connection's callback, in order; one it takes with its consumer full gives the reader an
    empty piece (wait for the consumer), later pieces queue for the reader; what it raises,
    the reader raises."""
    host, port = engine.split(":")
    pool = Pool(host, int(port))
    want = [b"data: %d\n\n" % i for i in range(5)]

    log: list[tuple[str, bytes]] = []  # who got which piece, in the order they got it

    def taking(full: bool) -> Callable[[bytes], bool]:
        def sink(data: bytes) -> bool:
            log.append(("sink", data))
            return not full

        return sink

    a = await pool.request("POST", "/stream", b"{}")
    async for c in a.chunks(taking(False)):
        log.append(("read", c))
    assert b"".join(d for _, d in log) == b"".join(want)
    assert ("sink" in {w for w, _ in log}) and all(d for _, d in log)

    log.clear()
    a = await pool.request("POST", "/stream", b"{}")
    async for c in a.chunks(taking(True)):  # its consumer always full
        log.append(("read", c))
    assert b"".join(d for _, d in log) == b"".join(want)
    sunk = [i for i, (w, _) in enumerate(log) if w == "sink"]
    assert sunk and all(log[i + 1] == ("read", b"") for i in sunk)  # each: the reader's cue

    a = await pool.request("POST", "/stream", b"{}")

    def broken(data: bytes) -> bool:
        raise RuntimeError("the consumer broke")

    with pytest.raises(RuntimeError, match="the consumer broke"):
        async for _ in a.chunks(broken):
            pass
    a.release()
    pool.close()


async def test_an_engine_that_is_not_there_is_an_upstream_error() -> None:
    pool = Pool("127.0.0.1", 9, connect_timeout_s=1.0)
    with pytest.raises(UpstreamError):
        await pool.request("POST", "/x", b"")


async def test_a_screen_refuses_on_the_headers_before_the_body_is_read() -> None:
    seen: list[str] = []

    def screen(method: str, path: str, headers: Headers, peer: str) -> str:
        seen.append(f"{method} {path} {peer}")
        if headers.get("Authorization") != "Bearer good":  # (any case)
            raise Refused(401, b'{"error": "who?"}')
        return "good"

    server = await serve(_handler, "127.0.0.1", 0, screen=screen)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        # the body never comes: the refusal does not wait for it
        answer = await _raw(url, b"POST /echo?x=1 HTTP/1.1\r\nContent-Length: 1000\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 401") and answer.endswith(b'{"error": "who?"}')
        async with aiohttp.ClientSession() as http:
            async with http.post(
                url + "/echo", data=b"b", headers={"Authorization": "Bearer good"}
            ) as r:
                assert r.status == 200
    assert seen == ["POST /echo 127.0.0.1", "POST /echo 127.0.0.1"]


async def test_an_http10_client_gets_its_stream_unchunked_and_the_connection_closes() -> None:
    server, url = await _server()
    async with server:
        answer = await _to_the_end(url, b"GET /stream HTTP/1.0\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head
    assert b"Connection: close" in head
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_a_client_that_expects_100_continue_is_told_to_go_on() -> None:
    server, url = await _server()
    host, port = url.removeprefix("http://").split(":")
    async with server:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\n"
            b"Connection: close\r\n\r\n"
        )
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(b"ok")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        # aiohttp's client: it sends the body only once it was told to go on
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/echo", data=b"later", expect100=True) as r,
        ):
            assert r.status == 200 and (await r.json())["body"] == "later"
    assert answer.startswith(b"HTTP/1.1 200") and b'"body":"ok"' in answer
