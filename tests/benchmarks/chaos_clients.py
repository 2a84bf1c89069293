"""Chaos scenarios of clients that attack the router's edge (tests/benchmarks/chaos.py runs them
beside the well-behaved load): one address's connection flood, poison records, large bodies while
``/health`` is probed, stalled readers holding the KV a low-priority tenant waits for."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

if TYPE_CHECKING:
    from tests.benchmarks.chaos import Chaos, Load

MODEL = "llama-3.1-8b"
LOW = "sk-low"  # a low-priority tenant (its requests are refused first past yellow)
STALL = "sk-stall"  # a tenant whose clients stop reading their streams


async def post_status(
    http: aiohttp.ClientSession, router: str, key: str, **kwargs: Any
) -> int | None:
    """A completion sent as ``key``'s tenant (``json=`` or ``data=``): its answer's status, None
    when none came."""
    headers = {"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with http.post(router + "/v1/completions", headers=headers, **kwargs) as r:
            await r.read()
            return r.status
    return None


def _port(chaos: Chaos) -> int:
    return int(chaos.router.rsplit(":", 1)[1])


async def _probe_health(chaos: Chaos, host: str, until: float) -> dict[str, Any]:
    """``/health`` from local address ``host`` every 50 ms until ``until``: answers, latency."""
    lat: list[float] = []
    fails = 0
    connector = aiohttp.TCPConnector(local_addr=(host, 0), force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        while time.monotonic() < until:
            t0 = time.monotonic()
            try:
                async with http.get(
                    chaos.router + "/health", timeout=aiohttp.ClientTimeout(total=10)
                ) as r:
                    await r.read()
                    if r.status == 200:
                        lat.append(time.monotonic() - t0)
                    else:
                        fails += 1
            except (aiohttp.ClientError, TimeoutError):
                fails += 1
            await asyncio.sleep(0.05)
    lat.sort()
    return {
        "health_ok": len(lat),
        "health_failed": fails,
        "health_p50_ms": round(1000 * lat[len(lat) // 2], 1) if lat else None,
        "health_max_ms": round(1000 * lat[-1], 1) if lat else None,
    }


async def connection_flood(chaos: Chaos, load: Load) -> dict[str, Any]:
    """One address (127.0.0.2) opens 1,000 idle connections, past its share (256): the rest
    are answered 503, while the tenants and a liveness probe (127.0.0.3) still get in."""
    port = _port(chaos)
    held: list[asyncio.StreamWriter] = []
    answers: Counter[str] = Counter()

    async def one() -> None:
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        except OSError:
            answers["connect_failed"] += 1
            return
        held.append(w)
        try:  # a refused connection gets its 503 at once; an admitted one stays silent
            line = await asyncio.wait_for(r.readline(), 0.5)
            answers[line.split(b" ")[1].decode() if line else "closed"] += 1
        except TimeoutError:
            answers["held"] += 1
        except (ConnectionError, IndexError):
            answers["reset"] += 1

    await asyncio.gather(*(one() for _ in range(1000)))
    health = await _probe_health(chaos, "127.0.0.3", time.monotonic() + chaos.args.scenario_s)
    for w in held:
        w.close()
    return {"flood_connections": dict(answers), **health}


async def poison_records(chaos: Chaos, load: Load) -> dict[str, Any]:
    """Requests whose ``user`` and ``session_id`` are 1.5 MiB each: records the broker would
    refuse whole. They are served with the identifiers digested; nothing jams the outbox."""
    big = "p" * (3 << 19)  # 1.5 MiB: two of them stay under the body limit (4 MiB)
    answers: Counter[int] = Counter()
    end = time.monotonic() + chaos.args.scenario_s
    i = 0
    while time.monotonic() < end:
        i += 1
        body = {"model": MODEL, "prompt": f"poison {i}", "max_tokens": 4, "user": big}
        body["session_id"] = big + str(i)
        status = await post_status(
            load.http,
            chaos.router,
            "sk-good-b",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        if status is not None:
            answers[status] += 1
        await asyncio.sleep(0.5)
    async with load.http.get(chaos.router + "/ready") as r:
        ready = await r.json(content_type=None)
    return {
        "poison_answers": {str(k): v for k, v in sorted(answers.items())},
        "ready_after": r.status,
        "kafka_refused": ready.get("kafka_refused"),
    }


async def large_bodies(chaos: Chaos, load: Load) -> dict[str, Any]:
    """Eight 4 MiB prompts at a time (a million tokens each: refused as too large once parsed
    and hashed) for the whole scenario, while ``/health`` is probed."""
    prompt = "lorem ipsum dolor sit amet " * ((4_000_000 - 200) // 27)
    raw = orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4})
    answers: Counter[int] = Counter()
    end = time.monotonic() + chaos.args.scenario_s

    async def sender() -> None:
        while time.monotonic() < end:
            status = await post_status(
                load.http,
                chaos.router,
                "sk-good-a",
                data=raw,
                headers={"Content-Type": "application/json"},
            )
            if status is not None:
                answers[status] += 1

    probe = asyncio.create_task(_probe_health(chaos, "127.0.0.4", end))
    await asyncio.gather(*(sender() for _ in range(8)))
    health = await probe
    return {"large_answers": {str(k): v for k, v in sorted(answers.items())}, **health}


async def _used_ratio(chaos: Chaos, load: Load) -> float:
    """The most used KV budget's share reserved now (the router's admin state)."""
    from tests.benchmarks.chaos import ADMIN

    async with load.http.get(
        chaos.router + "/v1/kvgate/state", headers={"Authorization": f"Bearer {ADMIN}"}
    ) as r:
        state = await r.json(content_type=None)
    return max((b["used_ratio"] or 0.0 for b in state["budgets"].values()), default=0.0)


async def _stalled_total(chaos: Chaos, load: Load) -> int:
    """The router's count of stalled clients it cut off."""
    async with load.http.get(chaos.router + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("kvgate_router_stalled_clients_total "):
            return int(float(line.split()[1]))
    return 0


async def stalled_low_priority(chaos: Chaos, load: Load) -> dict[str, Any]:
    """A tenant's streams whose clients never read, opened until they hold the yellow watermark
    (80 %) of the KV budget (below it capacity is anyone's; past it, the tenant's fair share
    stops it, and the tenants' own requests take it past); a low-priority tenant, refused past
    yellow, asks every 0.5 s. Once the streams stall, the stall budget cuts them (someone waits
    for KV), and the low tenant gets in."""
    port = _port(chaos)
    cut_before = await _stalled_total(chaos, load)
    loop = asyncio.get_running_loop()
    socks = []
    used = 0.0
    # large prompts to 70 %, then small ones: as close under yellow as a stream can get
    while len(socks) < 100 and (used := await _used_ratio(chaos, load)) < 0.795:
        words = 2000 if used < 0.7 else 200
        body = orjson.dumps(
            {"model": MODEL, "prompt": "stall " * words, "max_tokens": 4000, "stream": True}
        )
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: c\r\nAuthorization: Bearer {STALL}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        with contextlib.suppress(OSError):
            s.bind(("127.0.0.7", 0))  # the stalled clients' own address
            await loop.sock_connect(s, ("127.0.0.1", port))
            await loop.sock_sendall(s, head + body)
            socks.append(s)
        await asyncio.sleep(0.1)
    answers: Counter[int] = Counter()
    first_ok: float | None = None
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < chaos.args.scenario_s:
        i += 1
        low = {"model": MODEL, "prompt": f"a low-priority question {i}", "max_tokens": 8}
        status = await post_status(load.http, chaos.router, LOW, json=low)
        if status is not None:
            answers[status] += 1
            if status == 200 and first_ok is None:
                first_ok = time.monotonic() - t0
        await asyncio.sleep(0.5)
    cut = await _stalled_total(chaos, load) - cut_before  # before the clients go away
    for s in socks:
        s.close()
    return {
        "stalled_streams": len(socks),
        "cut_by_router": cut,
        "kv_used_with_them": round(used, 3),
        "low_priority_answers": {str(k): v for k, v in sorted(answers.items())},
        "low_priority_first_ok_s": round(first_ok, 1) if first_ok is not None else None,
    }


CLIENT_SCENARIOS: dict[str, Callable[[Chaos, Load], Awaitable[dict[str, Any]]]] = {
    "connection_flood": connection_flood,
    "poison_records": poison_records,
    "large_bodies": large_bodies,
    "stalled_low_priority": stalled_low_priority,
}
