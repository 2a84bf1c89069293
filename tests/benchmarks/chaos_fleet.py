"""Chaos scenarios of the fleet itself (tests/benchmarks/chaos.py runs them beside the
well-behaved load): most of the engines die at once.

``half_fleet_down``: three engines join the two (five in all, each with its agent); once the
router sees the five healthy, three are killed -9, engine and agent, under the load and a burst
of long requests from a high-priority and a low-priority tenant, each with more requests at once
than the two engines left can hold. The two left must stay busy — what they can carry admitted,
high priority first, the rest refused with a ``Retry-After`` — and the router must never answer
a 5xx of its own: the rule it replaces refused every request while less than half the fleet's KV
was healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

if TYPE_CHECKING:
    from tests.benchmarks.chaos import Chaos, Load

MODEL = "llama-3.1-8b"
HIGH = "sk-high"  # a high-priority tenant (served up to the whole budget)
JOINING = ("n3", "n4", "n5")  # the engines that join, then die
BURST = 24  # requests at once per burst tenant: together past what two engines hold


def error_type(raw: bytes) -> str:
    """The ``error.type`` of an OpenAI-shaped error body (``unreadable`` when it is not one)."""
    try:
        return str(orjson.loads(raw)["error"]["type"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "unreadable"


async def healthy_nodes(router: str) -> int:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with (
            aiohttp.ClientSession() as http,
            http.get(router + "/ready", timeout=aiohttp.ClientTimeout(total=3)) as r,
        ):
            return int((await r.json(content_type=None)).get("healthy_nodes", 0))
    return 0


async def _wait_nodes(router: str, want: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    got = await healthy_nodes(router)
    while got != want and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        got = await healthy_nodes(router)
    return got


async def _burst(
    http: aiohttp.ClientSession, router: str, key: str, until: float, counts: Counter[str]
) -> None:
    """One client of a burst tenant: long requests one after another until ``until``; a
    refusal is retried after the ``Retry-After`` it came with, as a client should."""
    while time.monotonic() < until:
        retry_s = 0.2
        # a prompt of its own (no prefix shared): the KV admission reserves is what it uses
        counts["sent"] += 1
        body = {
            "model": MODEL,
            "prompt": f"[{key} {counts['sent']}] " + "long task " * 300,
            "max_tokens": 800,
        }
        try:
            async with http.post(
                router + "/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=aiohttp.ClientTimeout(total=120),
            ) as r:
                raw = await r.read()
                counts["requests"] += 1
                if r.status == 200:
                    counts["ok"] += 1
                    continue
                if "X-Kvgate-Node" in r.headers:  # an engine's failure, passed on
                    counts["engine_errors"] += 1
                    continue
                if r.status >= 500 and r.status != 503:
                    counts["router_5xx"] += 1
                    counts[f"5xx_{r.status}_{error_type(raw)}"] += 1
                    continue
                counts[f"refused_{r.status}"] += 1
                counts[f"reason_{error_type(raw)}"] += 1
                after = r.headers.get("Retry-After")
                if after is None:
                    counts["refused_without_retry_after"] += 1
                else:
                    retry_s = float(after)
        except (aiohttp.ClientError, TimeoutError):
            counts["requests"] += 1
            counts["connection_errors"] += 1
        await asyncio.sleep(max(0.0, min(retry_s, until - time.monotonic())))


async def _busy(urls: list[str], until: float) -> dict[str, float]:
    """The engines left, sampled every second until ``until``: mean running requests and KV
    use per engine (their vLLM-style /metrics)."""
    running: list[float] = []
    kv: list[float] = []
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < until:
            for url in urls:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with http.get(url + "/metrics") as r:
                        for line in (await r.text()).splitlines():
                            if line.startswith("vllm:num_requests_running"):
                                running.append(float(line.split()[-1]))
                            elif line.startswith("vllm:kv_cache_usage_perc"):
                                kv.append(float(line.split()[-1]))
            await asyncio.sleep(1.0)
    return {
        "running_mean": round(sum(running) / max(1, len(running)), 1),
        "kv_used_mean": round(sum(kv) / max(1, len(kv)), 3),
    }


async def half_fleet_down(chaos: Chaos, load: Load) -> dict[str, Any]:
    for node in JOINING:
        chaos.nodes[node] = chaos.sup.spawn_node(node, 3000)
    before = await _wait_nodes(chaos.router, 5)
    for node in JOINING:  # engine and agent, -9: their heartbeats stop, their ports close
        chaos.sup.kill(f"engine-{node}")
        chaos.sup.kill(f"agent-{node}")
    killed_at = time.monotonic()
    until = killed_at + chaos.args.scenario_s
    tenants: dict[str, Counter[str]] = {"high": Counter(), "low": Counter()}
    keys = {"high": HIGH, "low": "sk-low"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        clients = [
            _burst(http, chaos.router, keys[name], until, counts)
            for name, counts in tenants.items()
            for _ in range(BURST)
        ]
        left = [url for node, url in chaos.nodes.items() if node not in JOINING]
        *_, busy = await asyncio.gather(*clients, _busy(left, until))
    after = await healthy_nodes(chaos.router)
    return {
        "healthy_before": before,
        "healthy_after": after,
        "engines_left": busy,
        "burst": {name: dict(sorted(c.items())) for name, c in tenants.items()},
    }


FLEET_SCENARIOS: dict[str, Callable[[Chaos, Load], Awaitable[dict[str, Any]]]] = {
    "half_fleet_down": half_fleet_down,
}
