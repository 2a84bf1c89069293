"""How many streamed requests per second one kvgate router process carries while adding at most
2 ms to the P99 time to first token — and the same for SGLang's model gateway, in the same run.

    pip install -e '.[peer]'    # sglang-router (the Rust gateway, from PyPI)
    python -m tests.benchmarks.proxy [--engines 2] [--rates 25,50,100,150,200] [--duration 8]

At each offered rate (Poisson arrivals of short streamed completions: the engine work is small,
so the proxy is what is measured) the client sends the same requests three ways, one after the
other: straight to the engines (round-robin: the baseline), through kvgate's router (admission
and routing on, the full path), and through sglang-router (`cache_aware`), after a 2 s warm-up
of each. The added TTFT is the
target's P99 minus the direct P99 at that rate. A target sustains a rate when nothing failed, it
delivered ≥ 95 % of the offered rate and the added P99 is ≤ 2 ms. Writes
``docs/benchmarks/proxy.json`` (``kvgate_rps``, ``sglang_rps``, ``added_ttft_p99_ms`` and every
point) and ``proxy.md``. Everything shares this machine's cores (engines, agents, Kafka, worker,
routers and the client): compare columns within a rate, not with other machines.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from deploy.procs import Supervisor, free_port
from tests.benchmarks.livepeer import MODEL, pct, report_header, wait_http

OUT = Path("docs/benchmarks")
LIMIT_MS = 2.0


async def one(http: aiohttp.ClientSession, url: str, i: int) -> float | None:
    body = {
        "model": MODEL,
        "prompt": f"request {i}: say hello",
        "max_tokens": 4,
        "stream": True,
    }
    started = time.perf_counter()
    ttft = None
    try:
        async with http.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return None
            async for line in r.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - started
    except (aiohttp.ClientError, TimeoutError):
        return None
    return ttft


async def run_rate(urls: list[str], rate: float, duration: float, seed: int) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` for ``duration`` s, spread round-robin over ``urls``."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while t < duration:
        t += rng.expovariate(rate)
        arrivals.append(t)
    targets = itertools.cycle(urls)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as http:
        start = time.perf_counter()
        tasks = []
        for i, at in enumerate(arrivals):
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(http, next(targets), i)))
        results = await asyncio.gather(*tasks)
        span = time.perf_counter() - start
    ok = [r for r in results if r is not None]
    return {
        "offered_rps": rate,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "throughput_rps": len(ok) / span,
        "ttft_p50_ms": (pct(ok, 0.5) or 0.0) * 1e3,
        "ttft_p99_ms": (pct(ok, 0.99) or 0.0) * 1e3,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        sys.exit("sglang-router is not installed: pip install -e '.[peer]'")
    sup = Supervisor(
        Path(tempfile.mkdtemp(prefix="kvgate-proxy-")),
        {
            "KVGATE_KAFKA__NAMESPACE": f"proxy{uuid.uuid4().hex[:8]}",
            "KVGATE_WORKER__DATA_DIR": tempfile.mkdtemp(prefix="kvgate-proxy-worker-"),
            "KVGATE_WORKER__WEB_PORT": str(free_port()),
        },
    )
    points: list[dict[str, Any]] = []
    try:
        engines = [sup.spawn_node(f"node-{i}") for i in range(args.engines)]
        for url in engines:
            await wait_http(url + "/health")
        sup.spawn("worker", "worker")
        kv_port, sgl_port = free_port(), free_port()
        sup.spawn("router", "router", "--port", str(kv_port))
        launch = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
        launch += ["--port", str(sgl_port), "--policy", "cache_aware", "--worker-urls", *engines]
        sup.spawn_argv("sglang-router", launch)
        kvgate, sglang = f"http://127.0.0.1:{kv_port}", f"http://127.0.0.1:{sgl_port}"
        await wait_http(kvgate + "/ready")
        await wait_http(sglang + "/v1/models")
        await asyncio.sleep(2.0)
        for urls in (engines, [kvgate], [sglang]):  # connections, topic metadata, caches
            await run_rate(urls, 20.0, 2.0, args.seed + 1)
        for rate in args.rates:
            row: dict[str, Any] = {"offered_rps": rate}
            for name, urls in (("direct", engines), ("kvgate", [kvgate]), ("sglang", [sglang])):
                row[name] = await run_rate(urls, rate, args.duration, args.seed)
                await asyncio.sleep(1.0)  # engines drain
            for name in ("kvgate", "sglang"):
                added = row[name]["ttft_p99_ms"] - row["direct"]["ttft_p99_ms"]
                row[name]["added_ttft_p99_ms"] = added
                row[name]["sustained"] = (
                    row[name]["errors"] == 0
                    and row[name]["throughput_rps"] >= 0.95 * rate
                    and added <= LIMIT_MS
                )
            points.append(row)
            print(json.dumps(row), flush=True)
    finally:
        sup.stop_all()
    return summarize(points)


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    def best(name: str) -> float:
        ok = [p["offered_rps"] for p in points if p[name]["sustained"]]
        return max(ok, default=0.0)

    kv = best("kvgate")
    at = next((p for p in points if p["offered_rps"] == kv), points[0] if points else None)
    return {
        "kvgate_rps": kv,
        "sglang_rps": best("sglang"),
        "added_ttft_p99_ms": at["kvgate"]["added_ttft_p99_ms"] if at else None,
        "limit_ms": LIMIT_MS,
        "points": points,
    }


def write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    report = {
        **report_header("tests.benchmarks.proxy"),
        "engines": args.engines,
        "duration_s_per_point": args.duration,
        **result,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "proxy.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = []
    for p in result["points"]:
        d, k, s = p["direct"], p["kvgate"], p["sglang"]
        lines.append(
            f"| {p['offered_rps']:.0f} | {d['ttft_p50_ms']:.1f} / {d['ttft_p99_ms']:.1f} | "
            f"{k['ttft_p50_ms'] - d['ttft_p50_ms']:+.1f} / {k['added_ttft_p99_ms']:+.1f} | "
            f"{k['throughput_rps']:.0f} | {k['errors']} | "
            f"{s['ttft_p50_ms'] - d['ttft_p50_ms']:+.1f} / {s['added_ttft_p99_ms']:+.1f} | "
            f"{s['throughput_rps']:.0f} | {s['errors']} |"
        )
    (OUT / "proxy.md").write_text(
        f"""# Proxy overhead: kvgate's router and SGLang's gateway

Command: `{report["command"]}`

Machine: {report["machine"]}; date {report["date"]}; sglang-router
{report["sglang_router_version"]} (`cache_aware`). {args.engines} simulated engines; at each
offered rate, {args.duration} s of Poisson arrivals of short streamed completions (4 tokens),
sent straight to the engines (baseline), through kvgate (admission + routing, the full path) and
through sglang-router, one after the other.

**kvgate sustains {result["kvgate_rps"]:.0f} req/s** with ≤ {LIMIT_MS} ms added P99 TTFT
(added P99 at that rate, or at the lowest rate when none qualified:
{_ms(result["added_ttft_p99_ms"])}); **sglang-router {result["sglang_rps"]:.0f} req/s**. (0: not
even the lowest rate stayed within the limit.) Everything — engines, agents, Kafka, the worker,
both routers and the client — shares the machine's 2 cores: the added latency includes the
competition for them, and single stalls of a process decide a P99 over ~200–1,600 requests.

{HEADER}
{chr(10).join(lines)}
"""
    )


HEADER = (
    "| offered req/s | direct TTFT p50 / p99 ms | kvgate added p50 / p99 ms | kvgate req/s "
    "| kvgate errors | sglang added p50 / p99 ms | sglang req/s | sglang errors |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:+.2f} ms"


def rewrite() -> None:
    """Regenerate proxy.md from proxy.json (same numbers)."""
    report = json.loads((OUT / "proxy.json").read_text())
    args = argparse.Namespace(engines=report["engines"], duration=report["duration_s_per_point"])
    sys.argv = ["", *report["command"].split()[3:]]
    write(args, report)


def cli() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[25.0, 50.0, 100.0, 150.0, 200.0],
    )
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    result = asyncio.run(main(args))
    write(args, result)


if __name__ == "__main__":
    cli()
