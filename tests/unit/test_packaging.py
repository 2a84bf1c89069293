"""Packaging: the base install (router, agent, simulated engine) works without the extras'
packages (faust, chDB, ClickHouse's client, Grafana's client, matplotlib), a command that needs an
extra says which, and the CLI knows its version."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from tests.deploykit import ROOT

BLOCK = "import sys\nfor m in {mods!r}: sys.modules[m] = None\n"
EXTRA_MODULES = (
    "faust",
    "mode",
    "chdb",
    "clickhouse_connect",
    "grafana_client",
    "matplotlib",
    "optuna",
    "statsmodels",
)


def _kvgate_without_extras(*argv: str) -> subprocess.CompletedProcess[str]:
    code = BLOCK.format(mods=EXTRA_MODULES) + (
        f"from deploy.cli import main\nsys.argv = ['kvgate', *{list(argv)!r}]\nmain()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )


def test_the_base_install_runs_router_agent_and_engine() -> None:
    for command in ("router", "agent", "engine"):
        done = _kvgate_without_extras(command, "--help")
        assert done.returncode == 0, (command, done.stderr[-2000:])
    code = BLOCK.format(mods=EXTRA_MODULES) + (
        "import router.serve, router.runtime, agents.agent, agents.simengine, streams.replica\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_command_that_needs_an_extra_says_which() -> None:
    done = _kvgate_without_extras("worker")
    assert done.returncode == 2
    assert "pip install 'kvgate[worker]'" in done.stderr and "faust" in done.stderr
    done = _kvgate_without_extras("tune", "--trace", "shared_prompt", "--budget", "1")
    assert done.returncode == 2 and "pip install 'kvgate[analytics]'" in done.stderr


def test_extras_declare_what_the_code_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    heavy = ("faust", "chdb", "clickhouse-connect", "grafana-client", "matplotlib", "optuna")
    for package in (*heavy, "statsmodels"):
        assert package not in base, package
    assert any(d.startswith("faust-streaming") for d in extras["worker"])
    assert {d.split(">")[0] for d in extras["analytics"]} == {
        "chdb",
        "clickhouse-connect",
        "grafana-client",
        "matplotlib",
        "optuna",
        "statsmodels",
    }
    assert extras["all"] == ["kvgate[worker,analytics,epp,otel]"] and "kvgate[all]" in extras["dev"]
    assert any(d.startswith("xds-protos") for d in extras["epp"])
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert project["license"] == "Apache-2.0"
    assert project["requires-python"] == ">=3.11,<3.14"  # CI tests 3.11, 3.12 and 3.13


def test_the_cli_knows_its_version() -> None:
    from importlib.metadata import version

    done = subprocess.run(
        [sys.executable, "-m", "deploy", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0 and done.stdout.strip() == f"kvgate {version('kvgate')}"


def test_json_logs_are_one_object_per_line() -> None:
    import json
    import logging

    from deploy.logs import JsonFormatter

    try:
        raise ValueError("boom")
    except ValueError:
        import sys as _sys

        record = logging.LogRecord(
            "kvgate.x", logging.ERROR, __file__, 1, "a %s", ("b",), _sys.exc_info()
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line.replace("\\n", "")
    out = json.loads(line)
    assert out["level"] == "ERROR" and out["logger"] == "kvgate.x" and out["message"] == "a b"
    assert "ValueError: boom" in out["exc"] and out["ts"].endswith("Z")


def test_log_options_are_checked() -> None:
    for argv in (["--log-level", "chatty", "settings"], ["--log-format", "xml", "settings"]):
        done = subprocess.run(
            [sys.executable, "-m", "deploy", *argv], capture_output=True, text=True, cwd=ROOT
        )
        assert done.returncode == 2, argv
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy",
            "--log-format",
            "json",
            "--log-level",
            "debug",
            "settings",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr


def test_progress_shows_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from analytics import progress

    monkeypatch.setenv("KVGATE_PROGRESS", "0")
    assert list(progress.tracked(iter([1, 2, 3]), 3, "x")) == [1, 2, 3]
    monkeypatch.setenv("KVGATE_PROGRESS", "1")
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stderr", captured)
    assert list(progress.tracked(iter([1, 2]), 2, "simulations")) == [1, 2]
    with progress.status("working"):
        pass


def test_the_epp_and_otel_extras_live_together() -> None:
    """xds-protos bundles an older opentelemetry/proto; deploy/otel-protos.sh restores
    opentelemetry-proto's files after installing (setup, CI, the image)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope

    assert external_processor_pb2.ProcessingRequest and OTLPSpanExporter and InstrumentationScope
    assert "otel-protos.sh" in (ROOT / "deploy" / "setup.sh").read_text()
    assert "otel-protos.sh" in (ROOT / "Dockerfile").read_text()
