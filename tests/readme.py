"""The README's own examples, run as written (tests/edge/test_readme_replay.py,
tests/integration/test_readme_plan.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme() -> str:
    return (ROOT / "README.md").read_text()


def bash_block(marker: str) -> str:
    """The README's first ``bash`` code block containing ``marker``."""
    return next(b for b in re.findall(r"```bash\n(.*?)```", readme(), re.S) if marker in b)


def run_script(script: str, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``script`` under ``bash -euo pipefail`` in ``cwd``, with this checkout's ``kvgate`` on
    the PATH (as after ``deploy/setup.sh``)."""
    assert "../" not in script, "a README example names a path outside the repository"
    bin_dir = str(Path(sys.executable).parent)
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=cwd,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)},
    )
