"""``kvgate replay``: a trace through the virtual-time cluster at a load relative to capacity."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from analytics.sim.cluster import SimConfig, simulate
from analytics.sim.metrics import run_metrics
from analytics.sim.traces import Trace, load_trace
from router.policies import make_policy
from router.settings import RouterSettings

__all__ = ["capacity_rps", "replay"]


def capacity_rps(trace: Trace, cfg: SimConfig, probe_requests: int = 1500) -> float:
    """Completed requests per second when the cluster is saturated (arrivals 50× compressed,
    least-requests routing): the reference for ``load``."""
    head = trace.head(probe_requests)
    offered = len(head.requests) / max(1e-9, head.span_s)
    done = simulate(head.scaled(1 / 50), make_policy(RouterSettings(policy="least_requests")), cfg)
    span = max(d.finish_s for d in done) - min(d.request.arrival_s for d in done)
    return min(len(done) / span, offered * 50)


def replay(
    path: Path,
    *,
    nodes: int,
    policy: str,
    load: float | None,
    limit: int | None = None,
    seed: int = 0,
    capacity: float | None = None,
    cfg: SimConfig | None = None,
) -> dict[str, Any]:
    """Replay ``path``; ``load`` (e.g. 0.8) rescales arrivals to that fraction of the measured
    capacity, ``None`` keeps the trace's own timing."""
    trace = load_trace(path, seed=seed)
    if limit is not None:
        trace = trace.head(limit)
    cfg = replace(cfg or SimConfig(), nodes=nodes, seed=seed)
    cap = None
    if load is not None:
        cap = capacity if capacity is not None else capacity_rps(trace, cfg)
        rate = len(trace.requests) / max(1e-9, trace.span_s)
        trace = trace.scaled(rate / (load * cap))
    settings = RouterSettings.model_validate({"policy": policy})
    started = time.perf_counter()
    done = simulate(trace, make_policy(settings), cfg)
    wall = time.perf_counter() - started
    out = run_metrics(done, nodes, trace.block_size)
    out.update(
        {
            "trace": trace.name,
            "policy": policy,
            "nodes": nodes,
            "load": load,
            "capacity_rps": cap,
            "offered_rps": len(trace.requests) / max(1e-9, trace.span_s),
            "sim_wall_s": round(wall, 2),
            "sim_requests_per_min": round(len(done) / wall * 60) if wall else None,
        }
    )
    return out
