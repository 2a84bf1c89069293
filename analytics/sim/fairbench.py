"""``fair_share`` of ``kvgate bench fleet``: three tenants of weights 1, 2 and 4 in two priority
bands (a and b normal, c high), each offering half of the pool's capacity (150 % in all), their
refused clients retrying after Retry-After. Per 60 s window (by first token): each tenant's share
of the KV-token work admitted, against its weighted max-min share of what was served (each
tenant gets at most what it asks; what one leaves is shared by the others by weight: here c's
half, then a and b 1 : 2 of the rest), and the longest admission-queue wait per priority against
its bound (``admission.queue_timeout_s``). The criterion: every tenant within 15 % of its share
in every window, no wait past its bound."""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any

from admission.plan import water_fill
from admission.settings import AdmissionSettings, Priority, Tenant
from analytics.sim.cluster import simulate
from analytics.sim.replay import capacity_rps, open_trace
from analytics.sim.simconfig import RetryModel, SimConfig, with_router
from analytics.sim.traces import Trace, TraceRequest
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["fair_section", "fair_share"]

TENANTS: tuple[tuple[str, float, Priority], ...] = (
    ("a", 1.0, "normal"),
    ("b", 2.0, "normal"),
    ("c", 4.0, "high"),
)
TOLERANCE = 0.15


def _with_tenants(trace: Trace) -> Trace:
    prio: dict[str, Priority] = {name: p for name, _, p in TENANTS}
    out = []
    for i, r in enumerate(trace.requests):
        name = TENANTS[zlib.crc32(f"t{r.session_id or i}".encode()) % len(TENANTS)][0]
        out.append(replace(r, client=name, priority=prio[name]))
    return Trace(trace.name, trace.block_size, tuple(out))


def fair_share(
    *, nodes: int = 4, requests: int = 20_000, load: float = 1.5, window_s: float = 60.0
) -> dict[str, Any]:
    tenants = {f"sk-{n}": Tenant(name=n, weight=w, priority=p) for n, w, p in TENANTS}
    adm = AdmissionSettings(tenants=tenants)
    settings = RouterSettings(policy="kvgate")
    trace0 = open_trace("multi_turn", limit=requests)
    cap = capacity_rps(trace0, SimConfig(nodes=nodes))
    rate = len(trace0.requests) / max(1e-9, trace0.span_s)
    trace = _with_tenants(trace0).scaled(rate / (load * cap))
    cfg = with_router(SimConfig(nodes=nodes, admission=adm, retries=RetryModel()), settings)
    done = simulate(trace, make_policy(settings), cfg)
    weights = {n: w for n, w, _ in TENANTS}
    t0 = trace.requests[0].arrival_s
    last = max(d.first_token_s for d in done)
    windows: list[dict[str, Any]] = []
    start = t0
    while start + window_s <= last:
        served = {n: 0 for n in weights}
        for d in done:
            if start <= d.first_token_s < start + window_s:
                served[d.request.client] += _work_of(d.request)
        offered = {n: 0 for n in weights}
        for r in trace.requests:
            if start <= r.arrival_s < start + window_s:
                offered[r.client] += _work_of(r)
        total = sum(served.values()) or 1
        # what each tenant asked, in shares of what was served: its weighted max-min share
        fair = water_fill(1.0, {n: offered[n] / total for n in weights}, weights)
        fair = {n: v / (sum(fair.values()) or 1) for n, v in fair.items()}
        share = {n: served[n] / total for n in weights}
        off = {n: round(share[n] / fair[n] - 1, 4) for n in weights}
        windows.append(
            {
                "start_s": round(start - t0, 1),
                "share": {n: round(v, 4) for n, v in share.items()},
                "weighted_share": {n: round(v, 4) for n, v in fair.items()},
                "off_by": off,
            }
        )
        start += window_s
    waits: dict[Priority, float] = {}
    for d in done:
        p = d.request.priority
        waits[p] = max(waits.get(p, 0.0), d.queue_wait_s)
    worst = max((abs(v) for w in windows for v in w["off_by"].values()), default=None)
    return {
        "nodes": nodes,
        "requests": len(trace.requests),
        "load": load,
        "tenants": {n: {"weight": w, "priority": p} for n, w, p in TENANTS},
        "windows": windows,
        "worst_off_by": worst,
        "within_15pct": worst is not None and worst <= TOLERANCE,
        "longest_queue_wait_s": {p: round(v, 3) for p, v in waits.items()},
        "queue_bound_s": dict(adm.queue_timeout_s),
        "waits_within_bound": all(
            v <= adm.queue_timeout_s.get(p, 0.0) + 1e-6 for p, v in waits.items()
        ),
        "completed": len(done),
    }


def _work_of(r: TraceRequest) -> int:
    """A request's KV-token work: its prompt and its output."""
    return r.prompt_tokens + r.output_tokens


def fair_section(r: dict[str, Any]) -> list[str]:
    f = r.get("fair_share")
    if not f:
        return []
    lines = [
        "",
        "## Fair shares under saturation (`fair_share`)",
        "",
        f"{f['nodes']} nodes at {f['load']:g}× their capacity, tenants a (weight 1, normal), "
        "b (2, normal), c (4, high), each offering a third; share of the KV-token work served "
        "per 60 s window against the weighted max-min share. Worst deviation "
        f"{f['worst_off_by']}; within 15 %: {f['within_15pct']}; longest queue waits "
        f"{f['longest_queue_wait_s']} (bounds {f['queue_bound_s']}).",
        "",
        "| window start (s) | a share / fair | b share / fair | c share / fair |",
        "|---|---|---|---|",
    ]
    for w in f["windows"]:
        cells = [f"{w['share'][n]:.3f} / {w['weighted_share'][n]:.3f}" for n in ("a", "b", "c")]
        lines.append(f"| {w['start_s']} | " + " | ".join(cells) + " |")
    return lines
