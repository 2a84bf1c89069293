"""Helpers for the tests of the deployment files (compose, Helm): kvgate's CLI as click sees it,
command lines, settings from an environment, and the Go validators built once per session."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import typer

from deploy.cli import app
from deploy.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
NOT_SETTINGS = {"KVGATE_HEALTH_URL", "KVGATE_LOCAL", "KVGATE_CONFIG"}  # read outside Settings


def command(name: str) -> Any:
    """The click command typer builds for ``kvgate <name>``."""
    group: Any = typer.main.get_command(app)
    cmd = group.commands.get(name)
    assert cmd is not None, f"kvgate has no command {name!r}"
    return cmd


def options(argv: list[str]) -> dict[str, str]:
    """``--flag value`` / ``--flag=value`` pairs of a command line (flags map to "")."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            out[flag] = value
        i += 1
    return out


def assert_real_command(argv: list[str], where: str) -> None:
    """``kvgate <argv>`` names a command, and every option it passes exists and parses."""
    cmd = command(argv[0])
    known = {opt for p in cmd.params for opt in p.opts}
    cmd.make_context(cmd.name, list(argv[1:]), resilient_parsing=False)
    for flag in options(argv[1:]):
        assert flag in known, f"{where}: kvgate {cmd.name} has no {flag}"


def assert_known_sections(env: dict[str, Any], where: str) -> None:
    """Every ``KVGATE_*`` variable names a settings section (an unknown one would be ignored)."""
    for key in env:
        if key.startswith("KVGATE_") and key not in NOT_SETTINGS:
            section = key.removeprefix("KVGATE_").split("__")[0].lower()
            assert section in Settings.model_fields, (where, key)


def go_build(package: Path, out: Path) -> Path:
    go = shutil.which("go")
    assert go is not None, "Go is needed to build the deployment validators (deploy/setup.sh)"
    subprocess.run([go, "build", "-o", str(out), "."], cwd=package, check=True)
    return out
