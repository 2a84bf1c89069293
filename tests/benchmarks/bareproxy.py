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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop")
    ap.add_argument("engines", nargs="+")
    args = ap.parse_args()
    loop = None
    if args.uvloop:
        import uvloop

        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
    web.run_app(build(args.engines), host="127.0.0.1", port=args.port, access_log=None, loop=loop)


if __name__ == "__main__":
    main()
