"""kvgate plan's search (analytics/fleetsize.py): few simulations, the right answer for fleets
of any size, and a clear "no" only when no fleet can meet the SLO."""

from __future__ import annotations

from typing import Any

import pytest

from agents.catalog import derive_profile, find_gpu, find_model
from agents.profile import EngineProfile
from analytics.fleetsize import alone, estimate_replicas, size_fleet
from analytics.plan import at_rate, parse_slo, plan
from analytics.sim.replay import replay_trace
from analytics.sim.simconfig import SimConfig
from analytics.sim.traces import Trace
from router.settings import RouterSettings


def _simulated(
    trace: Trace, warmup: float, profile: EngineProfile, nodes: int, ttft: float, tpot: float
) -> dict[str, Any]:
    """``trace`` on ``nodes`` engines of ``profile`` under kvgate, measured after ``warmup``."""
    return replay_trace(
        trace,
        nodes=nodes,
        policy=RouterSettings(policy="kvgate"),
        load=None,
        cfg=SimConfig(profile=profile),
        ttft_slo_s=ttft,
        tpot_slo_s=tpot,
        measure_from_s=warmup,
    )


def fleet(need: int) -> Any:
    """A workload that needs ``need`` replicas: below it nothing meets the SLO (attainment 0
    at every smaller count), yet TTFT halves with each doubling."""
    calls: list[int] = []

    def evaluate(n: int) -> dict[str, Any]:
        calls.append(n)
        ttft = 0.5 if n >= need else 0.5 * 2 ** (need / n)
        return {"slo_attainment": 1.0 if n >= need else 0.0, "ttft_p99_s": ttft}

    return evaluate, calls


@pytest.mark.parametrize("need", [1, 2, 3, 9, 13, 40, 150])
@pytest.mark.parametrize("start", [1, 8, 64])
def test_the_search_finds_the_smallest_fleet_from_any_start(need: int, start: int) -> None:
    evaluate, calls = fleet(need)
    sized = size_fleet(evaluate, 0.99, 256, start=start)
    assert sized.replicas == need and sized.why == "met"
    assert len(calls) == len(set(calls))  # no count simulated twice
    if need > 1:
        assert need - 1 in sized.tried  # the answer comes with the count that missed


def test_a_fleet_that_needs_more_than_8_replicas_is_found_though_4_and_8_miss_everything() -> None:
    evaluate, calls = fleet(21)
    sized = size_fleet(evaluate, 0.99, 256, start=4)
    assert sized.replicas == 21
    assert sized.tried[4]["slo_attainment"] == sized.tried[6]["slo_attainment"] == 0.0
    assert len(calls) <= 10


def test_more_replicas_that_improve_nothing_end_the_search_and_so_does_the_limit() -> None:
    flat = size_fleet(
        lambda n: {"slo_attainment": 0.9, "ttft_p99_s": 3.0, "tpot_p99_s": 0.2}, 0.99, 256, 4
    )
    assert flat.replicas is None and flat.why == "plateau" and max(flat.tried) == 6
    limited = size_fleet(fleet(300)[0], 0.99, 100, start=50)
    assert limited.replicas is None and limited.why == "limit" and max(limited.tried) == 100


def test_the_estimate_lands_near_the_simulated_answer() -> None:
    """The analytic start is within a factor of two of what the simulation finds."""
    model, gpu = find_model("llama-3.1-8b"), find_gpu("l40s")
    slo = parse_slo("ttft=1,tpot=0.1,attainment=0.95")
    report = plan(model, gpu, "multi_turn", rate=12.0, slo=slo, requests=300)
    n, start = report["fleet"]["kvgate"]["replicas"], report["search"]["start"]
    assert n is not None and n / 2 <= start <= 2 * n
    assert report["search"]["simulations"] == sum(
        len(side["tried"]) for side in report["fleet"].values()
    )


def test_an_slo_no_replica_meets_alone_is_refused_without_simulating() -> None:
    """TPOT 1 ms: no engine decodes that fast, however many there are. The floor (alone on an
    idle replica with every earlier block cached) is a bound no simulated fleet beats."""
    model, gpu = find_model("llama-3.1-8b"), find_gpu("l40s")
    report = plan(
        model, gpu, "multi_turn", rate=12.0, slo=parse_slo("ttft=1,tpot=0.001"), requests=200
    )
    side = report["fleet"]["kvgate"]
    assert side["replicas"] is None and side["why"] == "alone" and side["tried"] == []
    assert report["alone"]["tpot"] == 0.0 and report["search"]["simulations"] == 0
    trace, warmup = at_rate("multi_turn", 12.0, 200)
    profile = derive_profile(model, gpu)
    floor = alone(profile, trace, 0.3, 0.03, warmup)
    out = _simulated(trace, warmup, profile, 16, 0.3, 0.03)
    assert out["ttft_attainment"] <= floor["ttft"] + 1e-9
    assert out["tpot_attainment"] <= floor["tpot"] + 1e-9
    assert 0.0 < floor["both"] <= 1.0


def test_the_lean_warmup_keeps_what_the_measurement_depends_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every measured request, every earlier turn of a measured session and the whole traffic
    just before the measurement stay; the rest of the warm-up goes — and the simulated fleet
    sees the same hit rate and attainment within noise."""
    import analytics.plan as plan_module

    lean, warmup = at_rate("multi_turn", 60.0, 300)
    monkeypatch.setattr(plan_module, "FULL_LOAD_MIN", 10**9)
    full, same = at_rate("multi_turn", 60.0, 300)
    assert same == warmup and len(lean.requests) < 0.7 * len(full.requests)
    kept = set(lean.requests)
    assert kept <= set(full.requests)
    t0 = full.requests[0].arrival_s
    assert lean.requests[0] == full.requests[0]  # the measurement starts at the same time
    measured = [r for r in full.requests if r.arrival_s - t0 >= warmup]
    sessions = {r.session_id for r in measured}
    assert all(r in kept for r in measured)
    assert all(r in kept for r in full.requests if r.session_id in sessions)
    profile = derive_profile(find_model("llama-3.1-8b"), find_gpu("l40s"))
    out = [_simulated(t, warmup, profile, 12, 1.0, 0.1) for t in (lean, full)]
    assert out[0]["requests"] == out[1]["requests"]
    assert out[0]["hit_rate"] == pytest.approx(out[1]["hit_rate"], abs=0.03)
    assert out[0]["slo_attainment"] == pytest.approx(out[1]["slo_attainment"], abs=0.03)
    start = estimate_replicas(profile, lean, 60.0, 0.1, warmup)
    assert start == estimate_replicas(profile, full, 60.0, 0.1, warmup)
