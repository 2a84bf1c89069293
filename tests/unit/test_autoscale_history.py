"""A restarted autoscaler keeps its forecast: the arrival history rebuilt from the decision log
(analytics.autoscaler.load_history) against the embedded ClickHouse engine."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path
from typing import Any

from analytics.autoscale import AutoscaleSettings, Observation, Predictive
from analytics.autoscaler import AutoscaleService, arrival_history, history_query, load_history
from analytics.clickhouse import open_clickhouse
from analytics.rows import decision_row
from analytics.schema import migrate
from analytics.settings import ClickHouseSettings
from tests.factories import decision


def test_intervals_without_decisions_are_zeros_and_bad_rows_are_skipped() -> None:
    rows: list[dict[str, Any]] = [
        {"pool": "p", "model": "m", "bucket": 101, "n": 30},
        {"pool": "p", "model": "m", "bucket": 103, "n": "60"},
        {"pool": "p", "model": "m", "bucket": 99, "n": 5},  # before the window
        {"pool": "p", "model": "m", "bucket": "x", "n": 1},
        {"pool": "p", "n": 1},
        {"pool": "p", "model": "m", "bucket": 102, "n": -4},
    ]
    got = arrival_history(rows, 30.0, since=100 * 30.0, until=105 * 30.0)
    assert got == {("p", "m"): [0.0, 1.0, 0.0, 2.0, 0.0]}


def seasonal_rate(t: float, season_s: float) -> float:
    return 10.0 + 8.0 * math.sin(2 * math.pi * t / season_s)


def test_a_seeded_scaler_forecasts_the_season_a_cold_one_cannot() -> None:
    s = AutoscaleSettings(interval_s=60, season_s=3600, history_s=600, lead_time_s=600)
    per_season = 60
    # two and a half seasons recorded; "now" is just before the daily ramp's steepest part
    history = [seasonal_rate(i * 60.0, 3600) for i in range(2 * per_season + 45)]
    seeded, cold = Predictive(s, 1), Predictive(s, 1)
    seeded.seed(history)
    assert len(seeded.rates) == seeded.rates.maxlen == 2 * per_season + 1  # what it keeps
    junk = Predictive(s, 1)
    junk.seed([1.0, float("nan"), -3.0, float("inf")])  # dropped or floored, never fatal
    assert list(junk.rates) == [1.0, 0.0]
    now = len(history) * 60.0
    obs = Observation(
        now=now, replicas=2, arrivals=round(60 * seasonal_rate(now, 3600)), waiting=0,
        running=4, kv_used=0.3,
    )  # fmt: skip
    seeded.observe(obs)
    cold.observe(obs)
    truth = seasonal_rate(now + 600.0, 3600)  # what arrives one lead time later
    assert abs(seeded.last_forecast_rps - truth) < 0.2 * truth
    assert abs(cold.last_forecast_rps - truth) > abs(seeded.last_forecast_rps - truth)


def test_the_service_seeds_each_pool_from_the_decision_log(tmp_path: Path) -> None:
    s = AutoscaleSettings(interval_s=60, season_s=600, history_s=600)
    now = (time.time() // 60) * 60
    ch = open_clickhouse(ClickHouseSettings(path=str(tmp_path / "ch")))
    try:
        migrate(ch, "kvgate")
        rows = []
        for minute in range(1, 16):  # one decision per second-ish, rising
            for k in range(minute * 2):
                rid = f"r-{minute}-{k}"
                ts = now - minute * 60 + k
                rows.append(decision_row(decision(rid, ts=ts, pool="p1", model="m"), 0, len(rows)))
        rows.append({**rows[0], "kafka_offset": len(rows)})  # the same request, redelivered
        old = decision_row(decision("old", ts=now - 86400, pool="p1", model="m"), 0, len(rows))
        ch.insert_json("kvgate.decisions", [*rows, old])

        def query(sql: str) -> list[dict[str, Any]]:
            return ch.query(sql)

        history = asyncio.run(load_history(query, "kvgate", s, now))
    finally:
        ch.close()
    rates = history[("p1", "m")]
    assert len(rates) == 21  # two seasons and one interval
    assert rates[-1] == 2 / 60 and rates[-15] == 30 / 60  # the duplicate counted once
    assert rates[:6] == [0.0] * 6

    service = AutoscaleService.__new__(AutoscaleService)  # the decision core, without Kafka
    AutoscaleService.__init__(service, None, s, None)  # type: ignore[arg-type]
    service.seed(history)
    msgs = service.tick(now)
    assert [m.subject for m in msgs] == ["scale/p1/m"]  # decided although nothing is live
    scaler = service.scalers[("p1", "m")]
    assert isinstance(scaler, Predictive) and len(scaler.rates) == 21


def test_a_failing_or_hung_store_means_a_cold_start() -> None:
    s = AutoscaleSettings()
    release = threading.Event()

    def broken(sql: str) -> list[dict[str, Any]]:
        raise OSError("the chDB path is held by the sink")

    def hung(sql: str) -> list[dict[str, Any]]:
        release.wait(30)
        return [{"pool": "p", "model": "m", "bucket": 0, "n": 1}]

    async def main() -> tuple[dict[Any, Any], dict[Any, Any], bool]:
        a = await load_history(broken, "kvgate", s, time.time())
        b = await load_history(hung, "kvgate", s, time.time(), timeout_s=0.1)
        still_hung = not release.is_set()
        release.set()  # let the abandoned thread finish
        return a, b, still_hung

    broken_history, hung_history, returned_before_the_store = asyncio.run(main())
    assert broken_history == {} and hung_history == {}
    assert returned_before_the_store


def test_the_history_query_refuses_a_hostile_database_name() -> None:
    import pytest

    with pytest.raises(ValueError):
        history_query("kvgate; DROP TABLE x", 30, 0, 60)


def test_a_season_too_long_to_fit_keeps_the_trend_window_only() -> None:
    from analytics.autoscale import MAX_SEASON_INTERVALS, history_intervals

    assert history_intervals(AutoscaleSettings()) == 2 * 2880 + 1  # a day of 30 s, twice
    fine = AutoscaleSettings(interval_s=2.0)  # a day would be 43,200 intervals
    assert 86400 / 2.0 > MAX_SEASON_INTERVALS
    assert history_intervals(fine) == 900  # the 30 min trend window
