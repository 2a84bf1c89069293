"""User-identifying fields are kept only as long as ``sink.identity_retention_days`` says."""

from __future__ import annotations

import time
from pathlib import Path

from analytics.clickhouse import open_clickhouse
from analytics.rows import decision_row
from analytics.schema import apply_identity_retention, migrate
from analytics.settings import ClickHouseSettings
from tests.factories import decision


def test_identity_columns_expire_on_their_own_ttl(tmp_path: Path) -> None:
    ch = open_clickhouse(ClickHouseSettings(path=str(tmp_path / "ch")))
    try:
        migrate(ch, "kvgate")
        apply_identity_retention(ch, "kvgate", 7)
        row = decision_row(decision("r1"), 0, 1)
        row.update(session_id="user-42", client_request_id="abc")
        old = {**decision_row(decision("r2"), 0, 2), "session_id": "user-7"}
        old["ts"] = time.time() - 10 * 86400  # older than 7 days, younger than the rows' 30
        ch.insert_json("kvgate.decisions", [row, old])
        ch.command("OPTIMIZE TABLE kvgate.decisions FINAL")
        got = {
            r["request_id"]: r["session_id"]
            for r in ch.query("SELECT request_id, session_id FROM kvgate.decisions FINAL")
        }
        assert got["r1"] == "user-42"
        assert got["r2"] in (None, "")  # the row is kept, the identifying field is gone
        create = ch.query("SHOW CREATE TABLE kvgate.decisions")[0]
        assert "TTL toDateTime(ts) + toIntervalDay(7)" in str(create)
    finally:
        ch.close()


def test_a_ledger_event_sent_twice_is_one_row(tmp_path: Path) -> None:
    """The outbox may send a message twice (an ambiguous delivery failure): the copy lands at
    another offset and collapses on the event's identity (reservation, kind, time)."""
    from analytics.rows import ledger_row
    from tests.factories import ledger_event

    ch = open_clickhouse(ClickHouseSettings(path=str(tmp_path / "ch")))
    try:
        migrate(ch, "kvgate")
        ev = ledger_event("r1", "reserve")
        renew_ts = ev.ts + 1.0
        rows = [ledger_row(ev, 0, 10), ledger_row(ev, 0, 11)]
        rows.append({**ledger_row(ev, 0, 12), "kind": "renew", "ts": renew_ts})
        ch.insert_json("kvgate.ledger_events", rows)
        got = ch.query("SELECT kind, count() AS n FROM kvgate.ledger_events FINAL GROUP BY kind")
        assert {r["kind"]: int(r["n"]) for r in got} == {"reserve": 1, "renew": 1}
    finally:
        ch.close()
