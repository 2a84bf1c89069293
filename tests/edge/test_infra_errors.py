"""A command that cannot reach Kafka, or finds its port taken, ends with what failed and what
to do, and no traceback (``--log-level DEBUG`` keeps it); every command finds kvgate's state in
the same place from any working directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _kvgate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_kafka_down_is_two_lines_with_the_fix() -> None:
    env = {"KVGATE_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{_closed_port()}"}
    done = _kvgate("topics", env=env)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    mine = [line for line in done.stderr.splitlines() if line.startswith("kvgate:")]
    assert len(mine) == 1 and mine[0].startswith("kvgate: Kafka is unreachable")
    assert "kafka.sh start" in done.stderr
    debug = _kvgate("--log-level", "DEBUG", "topics", env=env)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_port_in_use_says_so() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _kvgate("engine", "--port", str(taken.getsockname()[1]))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "kvgate: cannot listen" in done.stderr and "address already in use" in done.stderr


def test_state_is_found_from_any_working_directory(tmp_path: Path) -> None:
    """The embedded ClickHouse and the worker's tables live in one directory whatever the
    current one is: the checkout's .local by default, KVGATE_HOME when set."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVGATE_HOME", "KVGATE_LOCAL")}
    env = {k: v for k, v in env.items() if not k.startswith(("KVGATE_CLICKHOUSE", "KVGATE_WORKER"))}
    paths = []
    for cwd, home in ((tmp_path, None), (ROOT, None), (tmp_path, tmp_path / "state")):
        extra = {} if home is None else {"KVGATE_HOME": str(home)}
        done = subprocess.run(  # the settings as kvgate resolves them, as JSON
            [sys.executable, "-m", "deploy", "settings"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
            env={**env, **extra, "PYTHONPATH": str(ROOT)},
            check=True,
        )
        s = json.loads(done.stdout)
        paths.append((s["clickhouse"]["path"], s["worker"]["data_dir"]))
    assert (
        paths[0]
        == paths[1]
        == (str(ROOT / ".local" / "clickhouse"), str(ROOT / ".local" / "worker"))
    )
    assert paths[2] == (str(tmp_path / "state" / "clickhouse"), str(tmp_path / "state" / "worker"))
