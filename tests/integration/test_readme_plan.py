"""The README's capacity-planning example runs as written from a checkout, and the figures the
README quotes for it are the ones the command prints (they are its output, not a memory of it)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.readme import bash_block, readme, run_script


def test_the_readmes_plan_example_prints_the_figures_the_readme_quotes(tmp_path: Path) -> None:
    done = run_script(bash_block("kvgate plan"), tmp_path, 400)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "replicas: SLO attainment" in done.stderr  # each fleet reported as it is simulated
    ours = re.search(r"kvgate: (\d+) replicas", done.stdout)
    theirs = re.search(r"round_robin: (\d+) replicas", done.stdout)
    assert ours and theirs, done.stdout
    assert (tmp_path / "plan.html").read_text().startswith("<!doctype html>")
    prose = " ".join(readme().split())
    quoted = re.search(
        r"on `multi_turn` at 100 req/s, (\d+) replicas with kvgate against (\d+) with round robin",
        prose,
    )
    assert quoted, "the README no longer quotes the example's figures"
    assert quoted.groups() == (ours.group(1), theirs.group(1)), done.stdout
    measured = re.search(
        r"`multi_turn` at 100 req/s: (\d+) replicas with kvgate, (\d+) with", prose
    )
    assert measured and measured.groups() == quoted.groups()
