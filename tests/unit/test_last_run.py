"""Replay and report read the last run by default: the traffic after the last stretch of more
than five minutes without a decision, not every run of the day merged."""

from __future__ import annotations

from pathlib import Path

from analytics.clickhouse import open_clickhouse
from analytics.recorded import last_run
from analytics.rows import decision_row
from analytics.schema import migrate
from analytics.settings import ClickHouseSettings
from tests.factories import decision


def test_the_last_run_starts_after_the_last_long_gap(tmp_path: Path) -> None:
    t = 1_800_000_000.0  # a minute's start
    ch = open_clickhouse(ClickHouseSettings(path=str(tmp_path / "ch")))
    try:
        migrate(ch, "kvgate")
        assert last_run(ch, "kvgate", t - 86400, t + 86400) is None  # nothing recorded
        # a run of 10 minutes, 30 minutes without traffic, a run of 5 minutes with a gap of
        # 3 minutes inside it (not a new run), then the window's end
        times = [t + 60 * m + 5 for m in range(10)]
        second = t + 60 * 40
        times += [second + 60 * m + 5 for m in (0, 1, 5, 6)]
        rows = [decision_row(decision(f"r{i}", ts=ts), 0, i) for i, ts in enumerate(sorted(times))]
        ch.insert_json("kvgate.decisions", rows)
        assert last_run(ch, "kvgate", t - 3600, t + 3 * 3600) == second
        # a window that starts inside the last run: at its first decision's minute
        assert last_run(ch, "kvgate", second + 120, t + 3 * 3600) == second + 300
        assert last_run(ch, "kvgate", t - 3600, t + 60 * 15) == t  # only the first run
    finally:
        ch.close()
