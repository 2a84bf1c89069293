"""The floor a proxy in Python can reach: an aiohttp pass-through with nothing else.

    python -m tests.benchmarks.bareproxy --port P ENGINE_URL [ENGINE_URL ...]

It forwards each POST to the next engine (round-robin), copies the body and the answer's bytes
as they come, and does nothing a router does (no parsing, admission, routing, recording). The
proxy benchmark (:mod:`tests.benchmarks.proxy`) measures kvgate's full path against it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import aiohttp
from aiohttp import web


def build(engines: list[str]) -> web.Application:
    turn = itertools.cycle(engines)
    app = web.Application()

    async def start(_: web.Application) -> None:
        app["http"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
        )

    async def stop(_: web.Application) -> None:
        await app["http"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        http: aiohttp.ClientSession = app["http"]
        async with http.post(
            next(turn) + request.path,
            data=body,
            headers={"Content-Type": request.headers.get("Content-Type", "application/json")},
        ) as up:
            resp = web.StreamResponse(status=up.status)
            resp.content_type = up.content_type
            await resp.prepare(request)
            async for data in up.content.iter_any():
                await resp.write(data)
            await resp.write_eof()
            return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", relay)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


async def wire(port: int, engines: list[str]) -> None:
    """The same pass-through on kvgate's wire layer (router/wire: asyncio protocols over
    httptools) instead of aiohttp."""
    from urllib.parse import urlsplit

    from router.wire.client import Pool
    from router.wire.server import Reply, Request, serve

    pools = []
    for url in engines:
        u = urlsplit(url)
        pools.append(Pool(u.hostname or "127.0.0.1", u.port or 80))
    turn = itertools.cycle(pools)

    async def relay(request: Request, reply: Reply) -> None:
        if request.method == "GET" and request.path == "/health":
            reply.send(200, b"ok", "text/plain")
            return
        ctype = request.headers.get("content-type", "application/json")
        up = await next(turn).request(
            "POST", request.path, request.body, (("Content-Type", ctype),)
        )
        reply.start(up.status, up.content_type)
        async for data in up.chunks():
            if not reply.write_nowait(data):
                await reply.drain()
        reply.end()

    server = await serve(relay, "127.0.0.1", port, backlog=512)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop")
    ap.add_argument("--wire", action="store_true", help="kvgate's wire layer, not aiohttp")
    ap.add_argument("engines", nargs="+")
    args = ap.parse_args()
    loop = None
    if args.uvloop:
        import uvloop

        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
    if args.wire:
        (loop or asyncio.new_event_loop()).run_until_complete(wire(args.port, args.engines))
        return
    web.run_app(build(args.engines), host="127.0.0.1", port=args.port, access_log=None, loop=loop)


if __name__ == "__main__":
    main()
