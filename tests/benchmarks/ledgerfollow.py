"""What following the ledger costs a router, and what a router that does not reconcile saves
now that only the reconciling one follows it (admission/reconciler.py).

One router serves short streamed completions at ``--rate`` over two simulated engines
(admission in Redis: a ``reserve`` and a ``release`` event on the ledger per request). Beside it
stand a second router that serves nothing and does not reconcile (it stops following the ledger
once its standby is over), and a bare ledger follower: :class:`streams.ledger.LedgerReplica`
alone in a process, what every router paid before, whether it reconciled or not. Measured: the
CPU each of the three spends per second at two rates, rounds of ``--duration`` s interleaved
(medians, and the spread), and from them the marginal CPU per request: what one more request a
second adds to each (a follower also has a fixed cost, its fetches, whatever the rate).

    python -m tests.benchmarks.ledgerfollow [--rates 100,400] [--duration 10] [--rounds 4]

Writes ``docs/benchmarks/ledgerfollow.json``. With R routers sharing a cluster's traffic, the
follower's figure was paid R times per request before, once now.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from admission.settings import RedisSettings
from deploy.procs import Supervisor, free_port
from tests.benchmarks.proxy import cpu_s, run_rate, wait_http

OUT = Path("docs/benchmarks/ledgerfollow.json")
ADMIN_KEY = "ledgerfollow-bench"


async def follow() -> None:
    """A ledger follower alone (what every router ran before), until killed."""
    from deploy.settings import Settings
    from streams.ledger import LedgerReplica

    s = Settings()
    replica = LedgerReplica(s.kafka, s.worker, "bench-ledger-follower")
    await replica.start()
    await asyncio.Event().wait()


async def _following(url: str) -> bool:
    import aiohttp

    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with (
        aiohttp.ClientSession() as http,
        http.get(url + "/v1/kvgate/state", headers=auth) as r,
    ):
        body = await r.json(content_type=None)
    return bool(body["reconciler"]["following_ledger"])


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    env = {
        "KVGATE_ADMISSION__BACKEND": "redis",
        "KVGATE_ADMISSION__RECONCILE_STANDBY_S": "5",
        "KVGATE_ROUTER__ADMIN_KEYS": json.dumps({ADMIN_KEY: "bench"}),
    }
    sup, namespace = Supervisor.isolated("ledgerfollow", env)
    try:
        engines = [sup.spawn_node(f"node-{i}") for i in range(2)]
        for url in engines:
            await wait_http(url + "/health")
        sup.spawn("worker", "worker")
        urls = {}
        procs = {}
        for name in ("serving", "standing"):
            port = free_port()
            procs[name] = sup.spawn(name, "router", "--port", str(port))
            urls[name] = f"http://127.0.0.1:{port}"
            await wait_http(urls[name] + "/ready")
        procs["follower"] = sup.spawn_argv(
            "follower", [sys.executable, "-m", "tests.benchmarks.ledgerfollow", "--follow"]
        )
        # the lease: who reconciles (the other router stops following after its standby)
        client = aioredis.Redis.from_url(RedisSettings().url)
        await run_rate([urls["serving"]], 20.0, 2.0, 1)
        await asyncio.sleep(8.0)
        held = await client.get(f"kvgate:{namespace}:reconciler")
        leader = held.decode() if isinstance(held, bytes) else str(held)
        await client.aclose()
        following = {n: await _following(u) for n, u in urls.items()}
        await run_rate([urls["serving"]], max(args.rates), 3.0, 2)  # warm
        # CPU per second of each process at each rate, rounds interleaved over the rates
        per_s: dict[float, dict[str, list[float]]] = {
            rate: {name: [] for name in procs} for rate in args.rates
        }
        served: dict[float, list[float]] = {rate: [] for rate in args.rates}
        errors = 0
        for r in range(args.rounds):
            for rate in args.rates if r % 2 == 0 else args.rates[::-1]:
                before = {n: cpu_s(p.pid) for n, p in procs.items()}
                t0 = time.monotonic()
                out = await run_rate([urls["serving"]], rate, args.duration, 10 + r)
                wall = time.monotonic() - t0
                after = {n: cpu_s(p.pid) for n, p in procs.items()}
                errors += out["errors"]
                served[rate].append((out["requests"] - out["errors"]) / wall)
                for n in procs:
                    per_s[rate][n].append((after[n] - before[n]) * 1e3 / wall)
                print(r, rate, {n: round(v[-1], 2) for n, v in per_s[rate].items()}, flush=True)
    finally:
        sup.stop_all()
    lo, hi = min(args.rates), max(args.rates)
    med = {rate: {n: statistics.median(v) for n, v in by.items()} for rate, by in per_s.items()}
    rps = {rate: statistics.median(v) for rate, v in served.items()}
    # the marginal cost: what one more request a second adds, from the two rates' medians
    marginal = {n: (med[hi][n] - med[lo][n]) / (rps[hi] - rps[lo]) for n in med[hi]}
    return {
        "rates_rps": args.rates,
        "served_rps": {str(k): round(v, 1) for k, v in rps.items()},
        "rounds": args.rounds,
        "duration_s": args.duration,
        "errors": errors,
        "reconciling_router": leader,
        "following_ledger": following,
        "cpu_ms_per_s": {
            str(rate): {n: round(v, 2) for n, v in by.items()} for rate, by in med.items()
        },
        "cpu_ms_per_s_spread": {
            str(rate): {n: [round(min(v), 2), round(max(v), 2)] for n, v in by.items()}
            for rate, by in per_s.items()
        },
        "marginal_cpu_ms_per_request": {n: round(v, 4) for n, v in marginal.items()},
        # what a router that does not reconcile no longer pays for each request the cluster
        # serves, against what the serving router spends on one
        "follow_share_of_serving": round(marginal["follower"] / marginal["serving"], 3),
        "standing_share_of_serving": round(marginal["standing"] / marginal["serving"], 3),
    }


def cli() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--follow", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--rates", type=lambda v: [float(x) for x in v.split(",")], default=[100.0, 400.0]
    )
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    from router.serve import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory("auto")) as runner:
        if args.follow:
            runner.run(follow())
            return
        result = runner.run(measure(args))
    report = {
        "command": "python -m tests.benchmarks.ledgerfollow " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        **result,
    }
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    cli()
