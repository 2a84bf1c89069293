"""The README's first command, end to end (Kafka and Redis already up, as in CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_demo_runs_end_to_end_and_summarizes_from_clickhouse(kafka_up: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KVGATE_KAFKA__BOOTSTRAP_SERVERS": kafka_up,
        "KVGATE_CLICKHOUSE__PATH": str(tmp_path / "ch"),
    }
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy",
            "demo",
            "--duration",
            "6",
            "--rps",
            "3",
            "--json",
            "--no-infra",
        ],
        env=env,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    summary = json.loads(res.stdout)
    for key in (
        "requests",
        "errors",
        "hit_rate",
        "ttft_p50_s",
        "ttft_p99_s",
        "decision_rows",
        "outcome_rows",
    ):
        assert key in summary
    assert summary["requests"] > 5
    assert summary["errors"] == 0
    assert summary["decision_rows"] == summary["outcome_rows"] == summary["requests"]
    assert summary["hit_rate"] > 0.3  # long shared system prompts are reused
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"]
    assert sum(n["requests"] for n in summary["per_node"].values()) == summary["requests"]
