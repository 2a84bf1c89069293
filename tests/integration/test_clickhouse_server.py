"""The clickhouse-connect backend (production path) against ClickHouse's HTTP protocol, served by
the chDB front in ``tests/chfront.py``: same migrations, inserts and summary SQL as chDB."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from analytics.clickhouse import ServerBackend
from analytics.exceptions import ClickHouseError
from analytics.rows import decision_row, outcome_row
from analytics.schema import MIGRATIONS, migrate
from analytics.settings import ClickHouseSettings
from analytics.summary import run_summary
from tests.chfront import ChdbFront
from tests.factories import decision, outcome

pytestmark = pytest.mark.integration


def test_server_backend_migrates_inserts_and_summarizes(tmp_path: Path) -> None:
    with ChdbFront(str(tmp_path / "ch")) as front:
        ch = ServerBackend(ClickHouseSettings(backend="server", port=front.port, compress=False))
        try:
            assert migrate(ch, "kvgate") == [m[0] for m in MIGRATIONS]
            assert migrate(ch, "kvgate") == []  # applied once
            now = time.time()
            decisions = [
                decision_row(decision(f"r{i}", now, router_id="rt", policy="seed_score"), 0, i)
                for i in range(5)
            ]
            outcomes = [
                outcome_row(outcome(f"r{i}", now, router_id="rt", ttft_s=0.02 * (i + 1)), 0, i)
                for i in range(5)
            ]
            assert ch.insert_json("kvgate.decisions", decisions) == 5
            assert ch.insert_json("kvgate.outcomes", outcomes) == 5
            ch.insert_json("kvgate.outcomes", outcomes[:2])  # a re-delivered batch
            summary = run_summary(ch, "kvgate", "rt")
            assert summary["requests"] == summary["decision_rows"] == 5
            assert summary["hit_rate"] == pytest.approx(0.75)
            assert summary["per_node"]["n1"]["requests"] == 5
            hashes = ch.query("SELECT block_hashes FROM kvgate.decisions FINAL LIMIT 1")
            assert hashes[0]["block_hashes"] == [11, 12, 13, 14]
            assert ch.query(
                "SELECT count() AS n FROM kvgate.decisions WHERE kv_blocks_estimate = 6"
            )[0]["n"] in (5, "5")
            with pytest.raises(ClickHouseError):
                ch.query("SELECT * FROM kvgate.no_such_table")
        finally:
            ch.close()
