"""``scale_from_zero`` of ``kvgate bench fleet``: a pool that starts with no engine at all, whose
engines come up a scripted delay after the first request (their pods start), under a steady
multi-turn load. With the waiting room (router/decision/scaleup.py, as live: requests wait up to
``router.scale_wait_s`` for the first ready node) every request that arrived within its bound is
served; without it (``scale_wait_s`` 0: the rule it replaces) the arrivals before the first node
is ready are refused."""

from __future__ import annotations

from typing import Any

from admission.settings import AdmissionSettings
from analytics.sim.admission import Refused
from analytics.sim.cluster import simulate
from analytics.sim.replay import capacity_rps, open_trace
from analytics.sim.simconfig import FleetOp, SimConfig, with_router
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["scale_from_zero", "zero_section"]


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


def scale_from_zero(
    *, nodes: int = 4, requests: int = 2000, start_delay_s: float = 30.0, load: float = 0.6
) -> dict[str, Any]:
    settings = RouterSettings(policy="kvgate")
    trace0 = open_trace("multi_turn", limit=requests)
    cap = capacity_rps(trace0, SimConfig(nodes=nodes))
    rate = len(trace0.requests) / max(1e-9, trace0.span_s)
    trace = trace0.scaled(rate / (load * cap))
    t0 = trace.requests[0].arrival_s
    ready_at = t0 + start_delay_s
    joins = tuple(FleetOp(ready_at, "join", f"node-{i:02d}") for i in range(nodes))
    out: dict[str, Any] = {
        "nodes": nodes,
        "requests": len(trace.requests),
        "start_delay_s": start_delay_s,
        "load": load,
        "scale_wait_s": settings.scale_wait_s,
    }
    for label, wait in (("waiting_room", settings.scale_wait_s), ("without", 0.0)):
        cfg = with_router(
            SimConfig(nodes=0, ops=joins, scale_wait_s=wait, admission=AdmissionSettings()),
            settings,
        )
        refused: list[Refused] = []
        done = simulate(trace, make_policy(settings), cfg, refused_out=refused)
        final = [r for r in refused if r.final]
        early = [d for d in done if d.request.arrival_s < ready_at]
        within = [r for r in trace.requests if r.arrival_s >= ready_at - wait]
        out[label] = {
            "served": len(done),
            "refused": len(final),
            "refused_by_reason": {
                str(k): sum(1 for r in final if r.reason == k) for k in {r.reason for r in final}
            },
            "arrived_before_ready": sum(1 for r in trace.requests if r.arrival_s < ready_at),
            "arrived_within_deadline": len(within),
            "served_of_those_before_ready": len(early),
            "early_ttft_p50_s": _pct([d.first_token_s - d.request.arrival_s for d in early], 0.5),
            "early_ttft_max_s": _pct([d.first_token_s - d.request.arrival_s for d in early], 1.0),
            "ttft_p99_s": _pct([d.first_token_s - d.request.arrival_s for d in done], 0.99),
        }
    out["refused_within_deadline"] = out["waiting_room"]["refused"]
    return out


def zero_section(r: dict[str, Any]) -> list[str]:
    z = r.get("scale_from_zero")
    if not z:
        return []
    lines = [
        "",
        "## A pool at zero (`scale_from_zero`)",
        "",
        f"{z['nodes']} engines are ready {z['start_delay_s']:g} s after the first request; the "
        f"waiting room holds requests up to `router.scale_wait_s` ({z['scale_wait_s']:g} s). "
        "`burst`: twice the load on a short trace — the backlog released when the engines are "
        "ready is larger than admission queues within its timeouts.",
        "",
        "| case | run | requests | served | refused (reasons) | arrived before ready "
        "| served of those | their TTFT p50 | their TTFT max | TTFT p99 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, row in (("load " + str(z["load"]), z), ("burst", z.get("burst") or {})):
        for label in ("waiting_room", "without"):
            v = row.get(label)
            if v is None:
                continue
            lines.append(
                f"| {case} | {label} | {row['requests']} | {v['served']} | {v['refused']} "
                f"{v['refused_by_reason'] or ''} | {v['arrived_before_ready']} | "
                f"{v['served_of_those_before_ready']} | {v['early_ttft_p50_s']} | "
                f"{v['early_ttft_max_s']} | {v['ttft_p99_s']} |"
            )
    return lines
