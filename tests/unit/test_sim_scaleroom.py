"""The simulator's waiting room at zero (analytics/sim/scaleroom.py): the live rule on a pool
that starts with no engine."""

from __future__ import annotations

from analytics.sim.zerobench import scale_from_zero


def test_a_pool_at_zero_serves_what_arrived_before_its_engines_were_ready() -> None:
    r = scale_from_zero(nodes=1, load=0.3, requests=400, start_delay_s=5.0)
    room, without = r["waiting_room"], r["without"]
    assert room["arrived_before_ready"] > 5
    assert room["refused"] == 0 and room["served"] == r["requests"]
    assert room["served_of_those_before_ready"] == room["arrived_before_ready"]
    assert 4.0 <= room["early_ttft_max_s"] <= 6.0  # they waited for the engine, no longer
    # the rule it replaces: everything before the first ready engine is turned away
    assert without["refused"] == without["arrived_before_ready"]
    assert without["refused_by_reason"] == {"scaling": without["refused"]}
