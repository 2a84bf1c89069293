"""``kvgate replay``: a trace through the virtual-time cluster at a load relative to capacity."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from analytics.sim.admission import Refused
from analytics.sim.cluster import simulate
from analytics.sim.metrics import latency_bounds, run_metrics
from analytics.sim.simconfig import SimConfig, acting_on, node_profile
from analytics.sim.traces import Trace, load_trace
from analytics.sim.workloads import WORKLOADS, make_workload
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["at_load", "bounds_at", "capacity_rps", "open_trace", "replay", "replay_trace"]


def capacity_rps(trace: Trace, cfg: SimConfig, probe_requests: int = 12_000) -> float:
    """The cluster's capacity on this trace: its saturated throughput. The first
    ``probe_requests`` arrive at once (a queue that never runs dry), routed by least-requests;
    the completion rate between the 25th and the 75th percentile of finish times — full batches,
    after the ramp and before the drain — is the capacity (requests per second)."""
    head = trace.head(probe_requests).looped(False)  # every request at once: the engines' limit
    burst = head.scaled(1e-6 / max(1e-9, head.span_s))
    # the engines' capacity: the whole burst queued at them (the router's queue cap, which
    # would refuse most of a burst, out of the way)
    engines = replace(cfg, max_queue=len(burst.requests))
    done = simulate(burst, make_policy(RouterSettings(policy="least_requests")), engines)
    finish = sorted(d.finish_s for d in done)
    a, b = finish[len(finish) // 4], finish[(3 * len(finish)) // 4]
    if b <= a:
        return len(finish) / max(1e-9, finish[-1] - burst.requests[0].arrival_s)
    return (len(finish) // 2) / (b - a)


def at_load(trace: Trace, load: float, capacity: float) -> Trace:
    """``trace`` with its arrivals rescaled to ``load`` × ``capacity`` requests per second."""
    rate = len(trace.requests) / max(1e-9, trace.span_s)
    return trace.scaled(rate / (load * capacity))


def bounds_at(
    trace: Trace,
    load: float,
    capacity: float,
    cfg: SimConfig | None = None,
    ttft_slo_s: float = 2.0,
) -> dict[str, float | None]:
    """:func:`analytics.sim.metrics.latency_bounds` of ``trace`` at ``load`` (as
    :func:`replay_trace` replays it) on the engines of ``cfg``."""
    profile = node_profile(cfg or SimConfig(), trace.block_size)
    return latency_bounds(at_load(trace, load, capacity).requests, profile, ttft_slo_s)


def open_trace(source: str | Path, *, limit: int | None = None, seed: int = 0) -> Trace:
    """A trace file (Mooncake .jsonl, Azure .csv) or the name of a generated workload."""
    if isinstance(source, str) and source in WORKLOADS:
        return make_workload(source, requests=limit or 12_000, seed=seed)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such trace (workloads: {', '.join(WORKLOADS)})")
    trace = load_trace(path, seed=seed)
    return trace.head(limit) if limit is not None else trace


def replay_trace(
    trace: Trace,
    *,
    nodes: int,
    policy: str | RouterSettings,
    load: float | None,
    seed: int = 0,
    capacity: float | None = None,
    cfg: SimConfig | None = None,
    ttft_slo_s: float = 2.0,
    tpot_slo_s: float = 0.1,
    measure_from_s: float = 0.0,
    measure_until_s: float | None = None,
) -> dict[str, Any]:
    """Replay ``trace``; ``load`` (e.g. 0.8) rescales arrivals to that fraction of the measured
    capacity, ``None`` keeps the trace's own timing. ``policy`` is a policy name or the whole
    router configuration (policy and weights) to evaluate. Requests arriving in the first
    ``measure_from_s`` seconds are simulated (they warm the caches) but not measured, nor are
    those arriving ``measure_until_s`` or later (they load the engines)."""
    cfg = replace(cfg or SimConfig(), nodes=nodes, seed=seed)
    cap = None
    if load is not None:
        cap = capacity if capacity is not None else capacity_rps(trace, cfg)
        trace = at_load(trace, load, cap)
    settings = (
        policy
        if isinstance(policy, RouterSettings)
        else RouterSettings.model_validate({"policy": policy})
    )
    cfg = acting_on(cfg, settings)
    stats: dict[str, int] = {}
    refused: list[Refused] = []
    started = time.perf_counter()
    done = simulate(trace, make_policy(settings), cfg, stats, refused)
    wall = time.perf_counter() - started
    final = [r for r in refused if r.final]
    if (measure_from_s > 0 or measure_until_s is not None) and trace.requests:
        since = trace.requests[0].arrival_s + measure_from_s
        until = trace.requests[0].arrival_s + (
            measure_until_s if measure_until_s is not None else float("inf")
        )
        done = [d for d in done if since <= d.request.arrival_s < until]
        final = [r for r in final if since <= trace.requests[r.index].arrival_s < until]
    profile = node_profile(cfg, trace.block_size)
    out = run_metrics(
        done,
        nodes,
        trace.block_size,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        cache_blocks_per_node=profile.num_gpu_blocks,
        prefill_tokens_per_s=profile.prefill_tokens_per_s,
        step_s=profile.step_base_s,
    )
    out.update(
        {
            "trace": trace.name,
            "policy": settings.policy,
            **({"policy_params": dict(settings.policy_params)} if settings.policy_params else {}),
            "nodes": nodes,
            "load": load,
            "capacity_rps": cap,
            "offered_rps": len(trace.requests) / max(1e-9, trace.span_s),
            **stats,
            # requests the router turned away for good (its 503s and 429s: no candidates,
            # no fit, a missed deadline), by reason: latency counts only beside these
            "refused": len(final),
            # of the requests offered: a refused request missed its SLO too
            **{
                key: (
                    out[key] * len(done) / (len(done) + len(final))
                    if done and key in out
                    else out.get(key)
                )
                for key in ("slo_attainment", "ttft_attainment", "tpot_attainment")
            },
            "refused_by_reason": dict(sorted(Counter(str(r.reason) for r in final).items())),
            "sim_wall_s": round(wall, 2),
            "sim_requests_per_min": round(len(done) / wall * 60) if wall else None,
        }
    )
    return out


def replay(
    source: str | Path,
    *,
    nodes: int,
    policy: str | RouterSettings,
    load: float | None,
    limit: int | None = None,
    seed: int = 0,
    capacity: float | None = None,
    cfg: SimConfig | None = None,
) -> dict[str, Any]:
    """:func:`replay_trace` on a trace file or a named workload."""
    trace = open_trace(source, limit=limit, seed=seed)
    return replay_trace(
        trace, nodes=nodes, policy=policy, load=load, seed=seed, capacity=capacity, cfg=cfg
    )
