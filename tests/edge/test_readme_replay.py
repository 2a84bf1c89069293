"""The README's offline replay example runs as written from a checkout: the trace it names
ships in the repository (traces/), and the candidate settings it writes are replayed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_replay_example_runs_from_the_checkout(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    block = next(
        b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "kvgate replay --trace" in b
    )
    # up to the replay (rolling the weights out needs a running cluster)
    script = block[: block.index("kvgate weights")]
    assert "traces/" in script and "../" not in script
    (tmp_path / "traces").symlink_to(ROOT / "traces")  # a checkout, without writing into it
    bin_dir = str(Path(sys.executable).parent)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["trace"] == "mooncake_fast25_synthetic_trace" and report["policy"] == "kvgate"
    assert report["failed"] == 0 and 0 < report["hit_rate"] <= 1
