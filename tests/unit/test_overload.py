"""Overload at 2× and 3× capacity with mixed priorities, through the simulated cluster: high
priority keeps its SLO, low priority absorbs the refusals, every refusal carries Retry-After."""

from dataclasses import replace

import pytest

from admission.settings import AdmissionSettings
from analytics.sim.overload import overload_run, with_priorities
from analytics.sim.replay import capacity_rps, open_trace
from analytics.sim.simconfig import SimConfig


@pytest.fixture(scope="module")
def setup() -> tuple[object, float]:
    trace = with_priorities(open_trace("shared_prompt", limit=4000))  # generated: no file needed
    return trace, capacity_rps(trace, replace(SimConfig(), nodes=4))


@pytest.mark.parametrize("load", [2.0, 3.0])
def test_overload_protects_high_priority(setup: tuple[object, float], load: float) -> None:
    trace, cap = setup
    off = overload_run(trace, capacity_rps=cap, load=load, nodes=4, admission=None)  # type: ignore[arg-type]
    on = overload_run(
        trace,  # type: ignore[arg-type]
        capacity_rps=cap,
        load=load,
        nodes=4,
        admission=AdmissionSettings(slots_per_node=64),
    )
    high, normal, low = (on["by_priority"][p] for p in ("high", "normal", "low"))
    assert high["slo_attainment_offered"] >= 0.99
    assert off["by_priority"]["high"]["slo_attainment_offered"] < 0.5  # what it protects from
    # low priority absorbs the refusals: refused the most, high the least
    share = {p: x["refused"] / x["offered"] for p, x in on["by_priority"].items()}
    assert share["low"] > 0.5 and share["low"] >= share["normal"] >= share["high"]
    for x in (high, normal, low):
        assert x["refusals_without_retry_after"] == 0
