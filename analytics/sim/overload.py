"""Overload experiments: offered load far above capacity, mixed priorities, with and without
admission control, on the simulated cluster (the live policy and admission code).

Each request gets a priority from a fixed share (default 20 % high, 50 % normal, 30 % low),
deterministically from its position. Per priority the result holds what was offered, completed
and refused (by reason, and whether every refusal carried a Retry-After), the SLO attainment of
the completed requests and of everything offered (a refusal counts as a miss), and TTFT
percentiles including time spent in the admission queue.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import replace
from typing import Any

from admission.settings import AdmissionSettings, Priority
from analytics.sim.admission import Refused
from analytics.sim.cluster import simulate
from analytics.sim.metrics import pct
from analytics.sim.simconfig import Done, SimConfig, with_router
from analytics.sim.traces import Trace
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["PRIORITY_MIX", "overload_run", "with_priorities"]

PRIORITY_MIX: tuple[tuple[Priority, float], ...] = (("high", 0.2), ("normal", 0.5), ("low", 0.3))


def with_priorities(trace: Trace, mix: tuple[tuple[Priority, float], ...] = PRIORITY_MIX) -> Trace:
    out = []
    for i, r in enumerate(trace.requests):
        u = (zlib.crc32(f"prio{i}".encode()) % 10_000) / 10_000
        acc = 0.0
        chosen: Priority = mix[-1][0]
        for name, share in mix:
            acc += share
            if u < acc:
                chosen = name
                break
        out.append(replace(r, priority=chosen))
    return Trace(trace.name, trace.block_size, tuple(out))


def _slo_ok(d: Done, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    ttft = d.first_token_s - d.request.arrival_s
    if ttft > ttft_slo_s:
        return False
    out = d.request.output_tokens
    return out <= 1 or (d.finish_s - d.first_token_s) / (out - 1) <= tpot_slo_s


def overload_run(
    trace: Trace,
    *,
    capacity_rps: float,
    load: float,
    nodes: int,
    admission: AdmissionSettings | None,
    policy: str = "kvgate",
    ttft_slo_s: float = 2.0,
    tpot_slo_s: float = 0.1,
) -> dict[str, Any]:
    """One run of ``trace`` (with priorities) at ``load`` × capacity."""
    rate = len(trace.requests) / max(1e-9, trace.span_s)
    scaled = trace.scaled(rate / (load * capacity_rps))
    settings = RouterSettings.model_validate({"policy": policy})
    cfg = with_router(SimConfig(nodes=nodes, admission=admission), settings)
    refused: list[Refused] = []
    done = simulate(scaled, make_policy(settings), cfg, refused_out=refused)
    per: dict[str, Any] = {}
    for prio, _ in PRIORITY_MIX:
        mine = [d for d in done if d.request.priority == prio]
        gone = [r for r in refused if r.priority == prio and r.final]
        offered = sum(1 for r in scaled.requests if r.priority == prio)
        ok = sum(1 for d in mine if _slo_ok(d, ttft_slo_s, tpot_slo_s))
        ttft = [d.first_token_s - d.request.arrival_s for d in mine]
        per[prio] = {
            "offered": offered,
            "completed": len(mine),
            "refused": len(gone),
            "refused_by_reason": dict(Counter(str(r.reason) for r in gone)),
            "refusals_without_retry_after": sum(1 for r in gone if r.retry_after_s is None),
            "queued": sum(1 for d in mine if d.queue_wait_s > 0),
            "slo_attainment_completed": ok / len(mine) if mine else None,
            "slo_attainment_offered": ok / offered if offered else None,
            "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99),
        }
    span = max((d.finish_s for d in done), default=0.0) - scaled.requests[0].arrival_s
    good = sum(1 for d in done if _slo_ok(d, ttft_slo_s, tpot_slo_s))
    return {
        "trace": trace.name,
        "load": load,
        "admission": admission is not None,
        "requests": len(scaled.requests),
        "throughput_rps": len(done) / span if span > 0 else 0.0,
        "goodput_rps": good / span if span > 0 else 0.0,
        "by_priority": per,
    }
