"""Autoscaling in the simulator: a diurnal day of traffic served three ways — a fixed fleet
sized for the peak, the reactive (queue-threshold) scaler, and kvgate's predictive signal
(``analytics/autoscale.py``) — with the GPU-hours each pays and the SLO attainment each gives.

The day is a homogeneous trace time-warped into a non-homogeneous Poisson process of rate
``mean × (1 − amplitude × cos(2π t / day))``: night at the start and the end, the peak at noon.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from agents.profile import EngineProfile
from analytics.autoscale import AutoscaleSettings
from analytics.sim.cluster import simulate
from analytics.sim.metrics import run_metrics
from analytics.sim.simconfig import ScalePoint, SimConfig, acting_on
from analytics.sim.traces import Trace
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["compare_scaling", "diurnal", "fixed_peak_replicas"]


def diurnal(trace: Trace, day_s: float, amplitude: float) -> Trace:
    """``trace`` (homogeneous arrivals) warped so that its rate follows the day: at time t the
    rate is ``mean × (1 − amplitude·cos(2πt/day))``. An arrival at ``u`` moves to the t where
    the cumulative intensity reaches ``mean·u``: t − A·sin(2πt/day) = u with A =
    amplitude·day/2π (Newton's method; monotone for amplitude < 1)."""
    if not 0 <= amplitude < 1:
        raise ValueError("amplitude must be within [0, 1)")
    if not trace.requests:
        return trace
    t0 = trace.requests[0].arrival_s
    big_a = amplitude * day_s / (2 * math.pi)
    w = 2 * math.pi / day_s
    out = []
    for r in trace.requests:
        u = r.arrival_s - t0
        t = u
        for _ in range(30):
            f = t - big_a * math.sin(w * t) - u
            t -= f / (1 - amplitude * math.cos(w * t))
            if abs(f) < 1e-6:
                break
        out.append(replace(r, arrival_s=t0 + t))
    return Trace(f"{trace.name} (diurnal)", trace.block_size, tuple(out))


def fixed_peak_replicas(peak_rps: float, s: AutoscaleSettings) -> int:
    """A fixed fleet for the peak, sized by the same rule as the autoscaler's steady state."""
    return max(s.min_replicas, math.ceil(peak_rps / (s.replica_rps * s.target_utilization)))


def _run(
    trace: Trace,
    profile: EngineProfile,
    router: RouterSettings,
    nodes: int,
    autoscaler: AutoscaleSettings | None,
    ttft_slo_s: float,
    tpot_slo_s: float,
) -> dict[str, Any]:
    cfg = acting_on(SimConfig(nodes=nodes, profile=profile, autoscaler=autoscaler), router)
    stats: dict[str, int] = {}
    points: list[ScalePoint] = []
    done = simulate(trace, make_policy(router), cfg, stats, scale_out=points)
    m = run_metrics(done, nodes, trace.block_size, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s)
    span = max(d.finish_s for d in done) - trace.requests[0].arrival_s if done else 0.0
    gpu_s = stats["gpu_seconds"] if autoscaler is not None else nodes * span
    return {
        "slo_attainment": m.get("slo_attainment"),
        "ttft_p99_s": m.get("ttft_p99_s"),
        "hit_rate": m.get("hit_rate"),
        "gpu_hours": gpu_s / 3600,
        "max_replicas": max((p.provisioned for p in points), default=nodes),
        "timeline": [
            (round(p.at_s - trace.requests[0].arrival_s), p.desired, p.serving, p.provisioned)
            for p in points
        ],
    }


def compare_scaling(
    trace: Trace,
    profile: EngineProfile,
    router: RouterSettings,
    settings: AutoscaleSettings,
    *,
    peak_rps: float,
    ttft_slo_s: float = 2.0,
    tpot_slo_s: float = 0.1,
) -> dict[str, Any]:
    """The day three ways; GPU-hours per GPU-replica (× tp for GPUs)."""
    peak = fixed_peak_replicas(peak_rps, settings)
    start = max(settings.min_replicas, 1)
    runs = {"fixed_peak": _run(trace, profile, router, peak, None, ttft_slo_s, tpot_slo_s)}
    for mode in ("reactive", "predictive"):
        scaler = settings.model_copy(update={"mode": mode})
        runs[mode] = _run(trace, profile, router, start, scaler, ttft_slo_s, tpot_slo_s)
    fixed = runs["fixed_peak"]
    for name in ("reactive", "predictive"):
        r = runs[name]
        r["gpu_hours_ratio_vs_peak"] = r["gpu_hours"] / fixed["gpu_hours"]
        r["slo_delta_points"] = 100 * (
            (r["slo_attainment"] or 0.0) - (fixed["slo_attainment"] or 0.0)
        )
    return {"fixed_peak_replicas": peak, "runs": runs}
