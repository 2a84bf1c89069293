"""How long ``kvgate plan`` takes to size a big fleet: multi_turn at 400 req/s, Llama-3.1-8B
on H100, 500 measured requests, run a few times in a row; writes
``docs/benchmarks/plan_search.json`` and ``.md``.

    python -m tests.benchmarks.plansearch [--repetitions 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.test_plan_large import COMMAND

OUT = Path("docs/benchmarks")
HEAD = (
    "| run | wall (s) | kvgate replicas | round-robin replicas | fleets simulated | "
    "search start | requests simulated |\n|---:|---:|---:|---:|---:|---:|---:|"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repetitions", type=int, default=3)
    args = ap.parse_args()
    runs = []
    for _ in range(args.repetitions):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "deploy", *COMMAND], capture_output=True, text=True, check=True
        )
        wall = time.perf_counter() - started
        report = json.loads(done.stdout)
        runs.append(
            {
                "wall_s": round(wall, 1),
                "replicas": report["fleet"]["kvgate"]["replicas"],
                "round_robin_replicas": report["fleet"]["round_robin"]["replicas"],
                "simulations": report["search"]["simulations"],
                "start": report["search"]["start"],
                "simulated_requests": report["simulated_requests"],
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    walls = [r["wall_s"] for r in runs]
    out = {
        "command": "kvgate " + " ".join(COMMAND),
        "benchmark": "python -m tests.benchmarks.plansearch " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
        "wall_s_median": statistics.median(walls),
        "wall_s_min": min(walls),
        "wall_s_max": max(walls),
        "target": "within 120 s on the 2-core machine",
        "met": max(walls) <= 120,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "plan_search.json").write_text(json.dumps(out, indent=2) + "\n")
    rows = "\n".join(
        f"| {i} | {r['wall_s']} | {r['replicas']} | {r['round_robin_replicas']} | "
        f"{r['simulations']} | {r['start']} | {r['simulated_requests']:,} |"
        for i, r in enumerate(runs)
    )
    (OUT / "plan_search.md").write_text(
        f"""# Sizing a big fleet: how long `kvgate plan` takes

Command: `{out["command"]}`, {len(runs)} times in a row (`{out["benchmark"]}`).

Machine: {out["machine"]}; date {out["date"]}.

{HEAD}
{rows}

Median {out["wall_s_median"]} s (min {out["wall_s_min"]}, max {out["wall_s_max"]}); target
{out["target"]}: **{"met" if out["met"] else "not met"}**. The run is deterministic (seeded):
the answer and the fleets simulated are the same each time; only the wall time varies.
"""
    )


if __name__ == "__main__":
    main()
