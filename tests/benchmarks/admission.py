"""Admission decision latency: the in-process store and the Redis store (loopback), same run.

    python -m tests.benchmarks.admission [--decisions 20000]

Each decision is what a router does per request: the budget snapshot from the store, the pure
verdict, the atomic check-and-reserve; then the release (timed separately). Needs Redis
(``deploy/local/redis.sh start``). Writes ``docs/benchmarks/admission.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from admission.gate import AdmissionGate
from admission.redis_store import RedisReservations
from admission.reservations import ReservationStore
from admission.settings import AdmissionSettings, Tenant
from streams.schemas import LedgerEvent

OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
NODES = [26_972] * 16


async def _noop(_: LedgerEvent) -> None:
    return None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(store: ReservationStore, n: int) -> dict[str, float]:
    gate = AdmissionGate(AdmissionSettings(), "bench", _noop, store)
    tenant = Tenant(name="t", priority="normal")
    admit_ms: list[float] = []
    release_ms: list[float] = []
    for i in range(n):
        now = time.time()
        t0 = time.perf_counter()
        v = await gate.admit(f"r{i}", tenant, 2000, 256, 16, "default", NODES, now)
        t1 = time.perf_counter()
        assert v.admitted
        await gate.release(f"r{i}", now)
        t2 = time.perf_counter()
        admit_ms.append((t1 - t0) * 1000)
        release_ms.append((t2 - t1) * 1000)
    return {
        "admit_p50_ms": round(pct(admit_ms, 0.5), 4),
        "admit_p99_ms": round(pct(admit_ms, 0.99), 4),
        "release_p50_ms": round(pct(release_ms, 0.5), 4),
        "release_p99_ms": round(pct(release_ms, 0.99), 4),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from admission.reservations import InProcessReservations

    inproc = await measure(InProcessReservations(), args.decisions)
    client = Redis.from_url(args.redis)
    try:
        redis = await measure(
            RedisReservations(client, f"bench:{uuid.uuid4().hex[:8]}"), args.decisions
        )
    finally:
        await client.aclose()
    return {
        "command": "python -m tests.benchmarks.admission " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "decisions": args.decisions,
        "inproc_p99_ms": inproc["admit_p99_ms"],
        "redis_p99_ms": redis["admit_p99_ms"],
        "inproc": inproc,
        "redis": redis,
    }


def write(r: dict[str, Any]) -> None:
    (OUT / "admission.json").write_text(json.dumps(r, indent=2) + "\n")
    lines = [
        "# Admission decision latency",
        "",
        f"Command: `{r['command']}`  ",
        f"Machine: {r['machine']}; date {r['date']}; {r['decisions']} sequential decisions per "
        "backend, 16 nodes in the budget. A decision = budget snapshot from the store + the pure "
        "verdict + the atomic check-and-reserve (the release is timed apart).",
        "",
        "| backend | admit p50 ms | admit p99 ms | target p99 | release p50 ms | release p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
        f"| in-process | {r['inproc']['admit_p50_ms']} | {r['inproc']['admit_p99_ms']} | ≤ 0.5 | "
        f"{r['inproc']['release_p50_ms']} | {r['inproc']['release_p99_ms']} |",
        f"| Redis (loopback, Lua) | {r['redis']['admit_p50_ms']} | {r['redis']['admit_p99_ms']} | "
        f"≤ 2 | {r['redis']['release_p50_ms']} | {r['redis']['release_p99_ms']} |",
        "",
        "The Redis path is two round trips: one pipeline for the budget snapshot (HMGET of the "
        "held totals, MGET of the per-5-s release counters for the drain rate) and the "
        "EVALSHA of the check-and-reserve script.",
        "",
    ]
    (OUT / "admission.md").write_text("\n".join(lines))


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--redis", default=os.environ.get("KVGATE_TEST_REDIS", "redis://127.0.0.1:16379/0")
    )
    p.add_argument("--decisions", type=int, default=20_000)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    result = asyncio.run(main(args))
    if not args.no_write:
        write(result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli()
