"""The README's offline replay example runs as written from a checkout: the trace it names
ships in the repository (traces/), and the candidate settings it writes are replayed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.readme import ROOT, bash_block, run_script


def test_the_readmes_replay_example_runs_from_the_checkout(tmp_path: Path) -> None:
    block = bash_block("kvgate replay --trace")
    # up to the replay (rolling the weights out needs a running cluster)
    script = block[: block.index("kvgate weights")]
    assert "traces/" in script
    (tmp_path / "traces").symlink_to(ROOT / "traces")  # a checkout, without writing into it
    done = run_script(script, tmp_path, 300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["trace"] == "mooncake_fast25_synthetic_trace" and report["policy"] == "kvgate"
    assert report["failed"] == 0 and 0 < report["hit_rate"] <= 1
