"""The router's CPU per request, one source tree against another.

    python -m tests.benchmarks.routercpu [--tree DIR ...] [--rate 600] [--duration 12]
        [--rounds 3] [--out docs/benchmarks/routercpu.json]

One kvgate router process (one worker, admission in Redis, records to Kafka: the proxy
benchmark's full path) in front of two simulated engines, driven at a fixed rate with the
proxy benchmark's client (Poisson arrivals of 4-token streamed completions); measured: the CPU
of the router's process per request, user and system time apart. Each ``--tree`` (a checkout of
kvgate, default: this one) runs its own router (its engines, worker and Kafka namespace fresh
each run, from this checkout); with several trees the runs alternate, tree by tree, for
``--rounds`` rounds, and the report gives each tree's median and its ratio to the first tree's:
on a shared machine a change shows as the ratio of runs made side by side, never as one
number against a number of another day (``docs/benchmarks/README.md``, Proxy).

Needs the Kafka and Redis of ``deploy/kafka/kafka.sh`` and ``deploy/local/redis.sh`` running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deploy.procs import Supervisor, free_port
from router.serve import event_loop_factory
from tests.benchmarks.livepeer import wait_http
from tests.benchmarks.proxy import cpu_times, drop_topics, run_rate

__all__ = ["measure", "report"]

WARMUP_RPS, WARMUP_S = 20.0, 2.0


async def measure(tree: Path, rate: float, duration: float, seed: int) -> dict[str, Any]:
    """One run of ``tree``'s router at ``rate``: CPU per request and what the client saw."""
    sup, namespace = Supervisor.isolated("rcpu")
    try:
        engines = [sup.spawn_node(f"node-{i}") for i in range(2)]
        for url in engines:
            await wait_http(url + "/health")
        sup.spawn("worker", "worker")
        port = free_port()
        router = sup.spawn_argv(
            "router",
            [sys.executable, "-m", "deploy", "router", "--port", str(port), "--workers", "1"],
            env={"KVGATE_ADMISSION__BACKEND": "redis", "PYTHONPATH": str(tree)},
            cwd=tree,
        )
        url = f"http://127.0.0.1:{port}"
        await wait_http(url + "/ready")
        await asyncio.sleep(2.0)  # its followers caught up, its garbage frozen
        await run_rate([url], WARMUP_RPS, WARMUP_S, seed + 1)
        user0, sys0 = cpu_times(router.pid)
        got = await run_rate([url], rate, duration, seed)
        user1, sys1 = cpu_times(router.pid)
        n = max(1, got["requests"])
        return {
            "cpu_ms_per_request": round((user1 - user0 + sys1 - sys0) * 1e3 / n, 4),
            "user_ms_per_request": round((user1 - user0) * 1e3 / n, 4),
            "system_ms_per_request": round((sys1 - sys0) * 1e3 / n, 4),
            "requests": got["requests"],
            "errors": got["errors"],
            "achieved_rps": round(got["achieved_rps"], 1),
            "ttft_p50_ms": round(got["ttft_p50_ms"], 2) if got["ttft_p50_ms"] else None,
            "ttft_p99_ms": round(got["ttft_p99_ms"], 2) if got["ttft_p99_ms"] else None,
        }
    finally:
        sup.stop_all()
        await drop_topics(namespace)


def report(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each tree's median CPU per request, its spread, and its ratio to the first tree's."""
    medians = {t: statistics.median(r["cpu_ms_per_request"] for r in rs) for t, rs in runs.items()}
    first = next(iter(medians.values()))
    return {
        tree: {
            "cpu_ms_per_request_median": round(medians[tree], 4),
            "cpu_ms_per_request_runs": [r["cpu_ms_per_request"] for r in rs],
            "ratio_to_first": round(medians[tree] / first, 3),
            "errors": sum(r["errors"] for r in rs),
        }
        for tree, rs in runs.items()
    }


def label(tree: Path) -> str:
    """``tree`` as the report names it: its commit when it is a git checkout (``+`` when it
    has changes not committed), else its path."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(tree), "describe", "--always", "--dirty=+"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(tree)
    return f"{rev} ({tree.name})"


async def main(args: argparse.Namespace) -> dict[str, Any]:
    trees = [Path(t).resolve() for t in args.tree] or [Path.cwd()]
    names = [label(t) for t in trees]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for tree, name in zip(trees, names, strict=True):
            got = await measure(tree, args.rate, args.duration, seed=7 + round_)
            runs[name].append(got)
            print(round_, name, json.dumps(got), flush=True)
    return {
        "command": "python -m tests.benchmarks.routercpu " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "rate_rps": args.rate,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "trees": report(runs),
        "runs": runs,
    }


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="a kvgate checkout (repeat)")
    ap.add_argument("--rate", type=float, default=600.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write the report here (JSON)")
    args = ap.parse_args()
    with asyncio.Runner(loop_factory=event_loop_factory("auto")) as runner:
        result = runner.run(main(args))
    print(json.dumps(result["trees"], indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    cli()
