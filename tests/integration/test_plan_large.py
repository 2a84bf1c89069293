"""``kvgate plan`` finds a fleet larger than 8 replicas, end to end: multi_turn at 400 req/s on
H100s, where 4 and 8 replicas meet the SLO for almost no request (the search once stopped
there and said no fleet would do). Its time is measured by ``python -m
tests.benchmarks.plansearch`` (docs/benchmarks/plan_search.md), not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [
    "plan",
    "--model",
    "llama-3.1-8b",
    "--gpu",
    "h100",
    "--workload",
    "multi_turn",
    "--rate",
    "400",
    "--requests",
    "500",
    "--slo",
    "ttft=1,tpot=0.05,attainment=0.99",
    "--json",
]


def test_a_fleet_of_more_than_8_replicas_is_planned() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "deploy", *COMMAND],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    side = report["fleet"]["kvgate"]
    n = side["replicas"]
    assert n is not None and n > 8, side
    assert side["at_size"]["slo_attainment"] >= 0.99
    assert side["one_fewer"]["slo_attainment"] < 0.99
    small = [t for t in side["tried"] if t["replicas"] <= 8]
    assert all(t["slo_attainment"] < 0.99 for t in small)
    # each fleet was reported as it was simulated
    assert done.stderr.count("replicas: SLO attainment") == report["search"]["simulations"]
