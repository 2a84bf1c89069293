"""Per-run metrics of a simulated replay (pure)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from agents.profile import EngineProfile
from analytics.sim.simconfig import Done
from analytics.sim.traces import (
    TraceRequest,
    causal_hit_bound,
    hit_bound,
    pooled_lru_bound,
    ttft_floors,
)

__all__ = ["latency_and_spread", "latency_bounds", "pct", "run_metrics"]


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_and_spread(
    ttft: Sequence[float], tpot: Sequence[float], e2e: Sequence[float], loads: Sequence[int]
) -> dict[str, Any]:
    """Percentiles of the latencies and the spread of requests over nodes (one definition for
    simulated and recorded runs)."""
    mean = statistics.fmean(loads) if loads else 0.0
    return {
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "tpot_p50_s": pct(tpot, 0.5),
        "tpot_p99_s": pct(tpot, 0.99),
        "e2e_p50_s": pct(e2e, 0.5),
        "e2e_p99_s": pct(e2e, 0.99),
        "load_cov": statistics.pstdev(loads) / mean if mean else 0.0,
        "max_over_mean_load": max(loads) / mean if mean else 0.0,
    }


def run_metrics(
    done: Sequence[Done],
    nodes: int,
    block_size: int,
    *,
    ttft_slo_s: float = 2.0,
    tpot_slo_s: float = 0.1,
    cache_blocks_per_node: int | None = None,
    node_ids: Sequence[str] = (),
    prefill_tokens_per_s: float | None = None,
    step_s: float | None = None,
) -> dict[str, Any]:
    if not done:
        return {"requests": 0}
    ttft = [d.first_token_s - d.request.arrival_s for d in done]
    tpot = [
        (d.finish_s - d.first_token_s) / (d.request.output_tokens - 1)
        for d in done
        if d.request.output_tokens > 1
    ]
    e2e = [d.finish_s - d.request.arrival_s for d in done]
    prompt = sum(d.request.prompt_tokens for d in done)
    cached = sum(d.cached_tokens for d in done)
    ttft_ok = [d.first_token_s - d.request.arrival_s <= ttft_slo_s for d in done]
    tpot_ok = [
        d.request.output_tokens <= 1
        or (d.finish_s - d.first_token_s) / (d.request.output_tokens - 1) <= tpot_slo_s
        for d in done
    ]
    ok = [d for d, a, b in zip(done, ttft_ok, tpot_ok, strict=True) if a and b]
    arrivals = sorted((d.request for d in done), key=lambda r: r.arrival_s)
    per_node = Counter(d.node for d in done)
    names = list(node_ids) or [f"node-{i:02d}" for i in range(nodes)]
    loads = [per_node.get(name, 0) for name in names]
    first = min(d.request.arrival_s for d in done)
    last = max(d.finish_s for d in done)
    span = max(1e-9, last - first)
    return {
        "requests": len(done),
        **latency_and_spread(ttft, tpot, e2e, loads),
        "hit_rate": cached / prompt if prompt else 0.0,
        "hit_bound": hit_bound(arrivals, block_size),
        "hit_bound_causal": (
            causal_hit_bound(arrivals, block_size, prefill_tokens_per_s, step_s)
            if prefill_tokens_per_s and step_s
            else None
        ),
        "hit_bound_pooled_lru": (
            pooled_lru_bound(
                arrivals,
                block_size,
                cache_blocks_per_node * nodes,
                prefill_tokens_per_s,
                step_s,
            )
            if cache_blocks_per_node
            else None
        ),
        "slo_attainment": len(ok) / len(done),
        "ttft_attainment": sum(ttft_ok) / len(done),
        "tpot_attainment": sum(tpot_ok) / len(done),
        "ttft_slo_s": ttft_slo_s,
        "tpot_slo_s": tpot_slo_s,
        "throughput_rps": len(done) / span,
        "goodput_rps": len(ok) / span,
        "reasons": dict(Counter(d.reason for d in done)),
    }


def latency_bounds(
    requests: Sequence[TraceRequest], profile: EngineProfile, ttft_slo_s: float = 2.0
) -> dict[str, float | None]:
    """What no routing policy can beat on these requests (:func:`ttft_floors`): the TTFT
    floor's p50 and p99 (lower bounds of every policy's, percentiles as :func:`pct` takes
    them) and the share of requests whose floor is within ``ttft_slo_s`` (an upper bound of
    the SLO attainment)."""
    floors = ttft_floors(requests, profile)
    return {
        "ttft_floor_p50_s": pct(floors, 0.5),
        "ttft_floor_p99_s": pct(floors, 0.99),
        "slo_bound": sum(1 for f in floors if f <= ttft_slo_s) / len(floors) if floors else None,
    }
