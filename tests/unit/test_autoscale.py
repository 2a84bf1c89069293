"""The autoscaling signal (analytics/autoscale.py) and its closed loop in the simulator."""

from __future__ import annotations

import itertools
import math

import pytest

from agents.catalog import derive_profile, find_gpu, find_model
from analytics.autoscale import AutoscaleSettings, Observation, Predictive, Reactive, forecast
from analytics.plan import router_for
from analytics.sim.cluster import simulate
from analytics.sim.scaling import compare_scaling, diurnal, fixed_peak_replicas
from analytics.sim.simconfig import ScalePoint, SimConfig
from analytics.sim.workloads import make_workload
from router.decision.policies import make_policy

S = AutoscaleSettings(
    replica_rps=5.0, interval_s=30, lead_time_s=120, scale_down_delay_s=300, season_s=3600
)


def _obs(t: float, rps: float, replicas: int, waiting: int = 0, kv: float = 0.3) -> Observation:
    return Observation(t, replicas, round(rps * S.interval_s), waiting, replicas * 4, kv)


def test_forecast_follows_a_trend_and_a_season() -> None:
    ramp = [10.0 + 0.5 * i for i in range(40)]
    assert forecast(ramp, 4) == pytest.approx(31.5, rel=0.05)  # four more steps of +0.5
    assert forecast([5.0, 5.0], 10) == 5.0  # too short for a trend: the last value
    assert forecast([3.0, 1.0, 0.0, 0.0, 0.0], 50) >= 0.0  # never negative
    season = [10 + 5 * math.sin(2 * math.pi * i / 24) for i in range(72)]
    ahead = forecast(season, 6, season=24)  # a quarter season on: the peak of the wave
    assert ahead == pytest.approx(15.0, abs=1.5)


def test_predictive_scales_up_before_the_load_and_down_slowly() -> None:
    p = Predictive(S, initial=2)
    got = []
    for i in range(30):  # arrivals ramp from 5 to 34 req/s
        got.append(p.observe(_obs(i * 30.0, 5 + i, replicas=got[-1] if got else 2)))
    assert got == sorted(got)  # never down on a ramp
    ahead = math.ceil(p.last_forecast_rps / (S.replica_rps * S.target_utilization))
    now = math.ceil((5 + 29) / (S.replica_rps * S.target_utilization))
    assert got[-1] == ahead > now  # sized for a lead time ahead, not for now
    peak = got[-1]
    t = 30 * 30.0
    downs = []
    for i in range(30):  # the load falls to 5 req/s at once
        downs.append(p.observe(_obs(t + i * 30.0, 5, replicas=downs[-1] if downs else peak)))
    held = int(S.scale_down_delay_s / S.interval_s)
    assert downs[:held] == [peak] * held  # hysteresis: nothing before the delay
    assert all(a - b in (0, 1) for a, b in itertools.pairwise(downs))  # one at a time
    assert downs[-1] < peak


def test_pressure_adds_a_replica_at_once_and_bounds_hold() -> None:
    p = Predictive(S.model_copy(update={"max_replicas": 3}), initial=1)
    assert p.observe(_obs(0, 1, replicas=1, waiting=10)) == 2  # queue above 4 per replica
    assert p.observe(_obs(30, 1, replicas=2, kv=0.95)) == 3  # KV nearly full
    assert p.observe(_obs(60, 1, replicas=3, waiting=100)) == 3  # max_replicas
    r = Reactive(S, initial=2)
    assert r.observe(_obs(0, 9, replicas=2, waiting=9)) == 3  # a queue: one more
    assert r.observe(_obs(30, 9, replicas=3)) == 3  # no queue, but 2 could not carry 9 req/s
    first = r.observe(_obs(60, 1, replicas=3))
    assert first == 3  # quiet, but the delay has not passed
    assert r.observe(_obs(60 + S.scale_down_delay_s, 1, replicas=3)) == 2


def test_the_closed_loop_adds_cold_nodes_after_the_lead_time_and_pays_for_them() -> None:
    profile = derive_profile(find_model("llama-3.1-8b"), find_gpu("l40s"))
    day = 1200.0
    trace = diurnal(make_workload("shared_prompt", requests=6000, rate=5.0, seed=1), day, 0.6)
    first, last = trace.requests[0].arrival_s, trace.requests[-1].arrival_s
    early = sum(1 for r in trace.requests if r.arrival_s - first < day / 10)
    noon = sum(1 for r in trace.requests if abs(r.arrival_s - first - day / 2) < day / 20)
    assert noon > 3 * early  # the warp: night at the start, the peak at noon
    settings = S.model_copy(update={"scale_down_delay_s": 120.0, "max_replicas": 8})
    points: list[ScalePoint] = []
    stats: dict[str, int] = {}
    cfg = SimConfig(nodes=1, profile=profile, autoscaler=settings)
    done = simulate(trace, make_policy(router_for(profile, "kvgate")), cfg, stats, scale_out=points)
    assert len(done) == len(trace.requests)
    assert max(p.provisioned for p in points) > 1 and points[-1].desired < max(
        p.desired for p in points
    )
    for a in points:  # a node asked for serves one lead time later, not before
        later = [b for b in points if b.at_s >= a.at_s + settings.lead_time_s + settings.interval_s]
        if later and a.desired > a.serving:
            assert later[0].serving >= min(a.desired, later[0].desired)
    used = {d.node for d in done}
    assert len(used) > 1  # the added nodes served
    # node time: between one node all day and the peak count all day
    paid_h = stats["gpu_seconds"] / 3600
    span = (max(d.finish_s for d in done) - first) / 3600
    assert span < paid_h < max(p.provisioned for p in points) * span
    assert last > first


def test_three_ways_on_a_short_day() -> None:
    profile = derive_profile(find_model("llama-3.1-8b"), find_gpu("l40s"))
    trace = diurnal(make_workload("shared_prompt", requests=6000, rate=5.0, seed=1), 1200.0, 0.6)
    settings = S.model_copy(update={"scale_down_delay_s": 120.0, "max_replicas": 8})
    got = compare_scaling(
        trace, profile, router_for(profile, "kvgate"), settings, peak_rps=5.0 * 1.6
    )
    assert got["fixed_peak_replicas"] == fixed_peak_replicas(8.0, settings) == 2
    runs = got["runs"]
    assert runs["fixed_peak"]["gpu_hours"] > 0
    for name in ("reactive", "predictive"):
        assert 0 < runs[name]["gpu_hours_ratio_vs_peak"]
        assert -100 <= runs[name]["slo_delta_points"] <= 100
