"""The README's first command, end to end (Kafka and Redis already up, as in CI)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest

from deploy.procs import LocalInfra, free_port

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

    # replay the recorded run from ClickHouse: a candidate that changes nothing changes no
    # decision; round-robin loses prefix hits; a tiny slot budget refuses requests
    def replay(candidate: str) -> dict[str, Any]:
        cfg = tmp_path / "candidate.yaml"
        cfg.write_text(candidate)
        html = tmp_path / "report.html"
        argv = ["replay", "--from-clickhouse", "--since", "-1h", "--config", str(cfg)]
        argv += ["--router-id", summary["router_id"]]
        res = subprocess.run(
            [sys.executable, "-m", "deploy", *argv, "--html", str(html), "--json"],
            env=env,
            capture_output=True,
            timeout=300,
            check=False,
        )
        assert res.returncode == 0, res.stderr.decode()[-3000:]
        assert "<img" in html.read_text()
        return cast(dict[str, Any], json.loads(res.stdout))

    same = replay("router:\n  policy: kvgate\n")
    sides = same["sides"]
    assert sides["recorded"]["metrics"]["offered"] == summary["requests"]
    assert abs(sides["recorded"]["metrics"]["hit_rate"] - summary["hit_rate"]) < 1e-9
    assert same["changes_vs_current"]["changed"] == 0
    assert sides["replay: candidate"]["metrics"] == sides["replay: current"]["metrics"]

    rr = replay("router:\n  policy: round_robin\n")
    cur = rr["sides"]["replay: current"]["metrics"]
    cand = rr["sides"]["replay: candidate"]["metrics"]
    assert cand["hit_rate"] < cur["hit_rate"]
    assert cand["load_cov"] < cur["load_cov"] + 1e-9  # round-robin spreads evenly
    assert rr["changes_vs_current"]["changed"] > 0
    assert all(k.endswith("→ round_robin") for k in rr["changes_vs_current"]["by_reason"])

    # a weight: prefill worth nothing → cache hits stop pulling requests together
    w = replay("router:\n  cost:\n    prefill_weight: 0.0\n")
    assert w["sides"]["replay: candidate"]["settings"]["weight prefill_weight"] == 0.0
    assert w["changes_vs_current"]["changed"] > 0

    tight = replay(  # one request at a time in the whole cluster
        "admission:\n  slots_per_node: 1\n  queue_enabled: false\n  yellow_watermark: 0.2\n"
        "  red_watermark: 0.25\n"
    )
    refused = tight["sides"]["replay: candidate"]["metrics"]
    assert refused["refused"] > 0 and set(refused["rejections"]) <= {
        "red_watermark",
        "yellow_low_priority",
    }
    assert tight["changes_vs_current"]["now_refused"] == refused["refused"]

    # the same recording planned and tuned: kvgate plan and kvgate tune read the window too
    def run(*argv: str) -> dict[str, Any]:
        res = subprocess.run(
            [sys.executable, "-m", "deploy", *argv, "--json"],
            env=env,
            capture_output=True,
            timeout=300,
            check=False,
        )
        assert res.returncode == 0, res.stderr.decode()[-3000:]
        return cast(dict[str, Any], json.loads(res.stdout))

    plan = run(
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "l40s",
        "--from-clickhouse",
        "--since",
        "-1h",
        "--rate",
        "20",
        "--requests",
        "100",
    )
    assert plan["requests"] == summary["requests"] and plan["rate_rps"] == 20
    assert plan["fleet"]["kvgate"]["replicas"] >= 1
    tuned = run(
        "tune",
        "--from-clickhouse",
        "--since",
        "-1h",
        "--router-id",
        summary["router_id"],
        "--budget",
        "3",
        "--objective",
        "p99",
        "--out",
        str(tmp_path / "tuned.yaml"),
    )
    assert tuned["tuning"]["trials"] == 3
    assert tuned["sides"]["recorded"]["metrics"]["offered"] == summary["requests"]
    assert "current_vs_recorded" in tuned  # the simulator's error on this traffic
    assert "prefill_weight" in (tmp_path / "tuned.yaml").read_text()


def _processes_with(marker: bytes) -> list[int]:
    """Processes whose environment holds ``marker`` (a demo's own Kafka address)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_sigterm_stops_everything_the_demo_started(tmp_path: Path) -> None:
    """SIGTERM (what timeout, CI runners, Docker and systemd send) tears the demo down as Ctrl-C
    does: its engines, agents, worker, router, and the Kafka and Redis it started itself."""
    kafka, redis = free_port(span=2), free_port()  # (Kafka's controller listens on port + 1)
    marker = f"127.0.0.1:{kafka}"
    env = {
        **os.environ,
        "KVGATE_KAFKA__BOOTSTRAP_SERVERS": marker,
        "KVGATE_REDIS__URL": f"redis://127.0.0.1:{redis}/0",
        "KVGATE_CLICKHOUSE__PATH": str(tmp_path / "ch"),
        "KVGATE_HOME": str(tmp_path / ".local"),  # its logs: where this test looks
    }
    demo = subprocess.Popen(
        [sys.executable, "-m", "deploy", "demo", "--duration", "300", "--engines", "2"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # until the router answers requests
            logs = list((tmp_path / ".local" / "demo").glob("*/router.log"))
            if logs and "listening" in logs[0].read_text(errors="replace"):
                break
            assert demo.poll() is None, demo.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            time.sleep(0.5)
        else:
            raise AssertionError("the demo's router never started")
        assert len(_processes_with(marker.encode())) >= 6  # 2 engines, 2 agents, worker, router
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(120) is not None
    finally:
        if demo.poll() is None:
            demo.kill()
    deadline = time.monotonic() + 30
    while _processes_with(marker.encode()) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _processes_with(marker.encode())
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]
    infra = LocalInfra(kafka_port=kafka, redis_port=redis)
    assert infra.run("kafka", "status").returncode != 0  # stopped: it had started them
    assert infra.run("redis", "status").returncode != 0
    infra.run("kafka", "wipe")  # the broker's data, log and configuration, on its port alone
    infra.run("redis", "wipe")
