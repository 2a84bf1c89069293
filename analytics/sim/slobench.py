"""``slo_mix`` of ``kvgate bench fleet``: 30 % interactive and 70 % batch requests at 120 % load,
per workload — today's priorities alone (interactive high, batch low) against the SLO classes
(admission.slo_classes): each class's attainment among completed requests, what was completed
and refused, and whether every refusal carried a Retry-After."""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import replace
from typing import Any

from admission.settings import DEFAULT_SLO_CLASSES, AdmissionSettings
from analytics.sim.admission import Refused
from analytics.sim.bench_report import fmt
from analytics.sim.cluster import simulate
from analytics.sim.replay import capacity_rps, open_trace
from analytics.sim.simconfig import Done, SimConfig, with_router
from analytics.sim.traces import Trace
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["SLO_WORKLOADS", "slo_mix", "slo_section"]


SLO_WORKLOADS = ("multi_turn", "shared_prompt", "long_tail")
INTERACTIVE_SHARE = 0.3


def _with_classes(trace: Trace, classes: bool) -> Trace:
    """30 % interactive, the rest batch: SLO classes, or (``classes`` False) only the
    priorities an operator would give them without classes (high and low)."""
    out = []
    for i, r in enumerate(trace.requests):
        inter = (zlib.crc32(f"slo{i}".encode()) % 1000) / 1000 < INTERACTIVE_SHARE
        if classes:  # a request runs at its class's priority (admission/slo.py)
            cls = "interactive" if inter else "batch"
            r = replace(r, slo_class=cls, priority=DEFAULT_SLO_CLASSES[cls].priority)
        else:
            r = replace(r, priority="high" if inter else "low")
        out.append(replace(r, client="interactive" if inter else "batch"))
    return Trace(trace.name, trace.block_size, tuple(out))


def _met(d: Done, ttft_s: float, tpot_s: float) -> bool:
    out = d.request.output_tokens
    return d.first_token_s - d.request.arrival_s <= ttft_s and (
        out <= 1 or (d.finish_s - d.first_token_s) / (out - 1) <= tpot_s
    )


def slo_mix(name: str, *, nodes: int, requests: int, load: float) -> dict[str, Any]:
    """The ``slo_mix`` rows of one workload: without and with SLO classes."""
    adm = AdmissionSettings()
    trace0 = open_trace(name, limit=requests)
    cap = capacity_rps(trace0, SimConfig(nodes=nodes))
    rate = len(trace0.requests) / max(1e-9, trace0.span_s)
    settings = RouterSettings(policy="kvgate")
    cfg = with_router(SimConfig(nodes=nodes, admission=adm), settings)
    out: dict[str, Any] = {"capacity_rps": round(cap, 3)}
    for label, classes in (("priorities", False), ("slo_classes", True)):
        trace = _with_classes(trace0, classes).scaled(rate / (load * cap))
        refused: list[Refused] = []
        done = simulate(trace, make_policy(settings), cfg, refused_out=refused)
        row: dict[str, Any] = {}
        for cls in ("interactive", "batch"):
            target = adm.slo_classes[cls]
            mine = [d for d in done if d.request.client == cls]
            gone = [r for r in refused if r.final and trace.requests[r.index].client == cls]
            offered = sum(1 for r in trace.requests if r.client == cls)
            met = sum(1 for d in mine if _met(d, target.ttft_s, target.tpot_s))
            row[cls] = {
                "offered": offered,
                "completed": len(mine),
                "slo_attainment": round(met / len(mine), 4) if mine else None,
                "refused": len(gone),
                "refused_by_reason": dict(Counter(str(r.reason) for r in gone)),
                "refusals_without_retry_after": sum(1 for r in gone if not r.retry_after_s),
            }
        out[label] = row
    return out


def slo_section(r: dict[str, Any]) -> list[str]:
    """The SLO classes at 120 % load."""
    lines = [
        "",
        "## SLO classes at 120 % load",
        "",
        "30 % interactive (TTFT 2 s, TPOT 0.1 s) and 70 % batch (TTFT 600 s, TPOT 1 s) requests, "
        "16 nodes, 6,000 requests per workload. `priorities`: today's admission with interactive "
        "high and batch low; `slo_classes`: the default classes (interactive high; batch normal, "
        "queueing up to its TTFT, routed with queue weight 0.3 and held in the router while its "
        "best node has more than 0.1 s queued). Attainment is among completed requests.",
        "",
        "| workload | run | class | offered | completed | SLO attainment | refused | "
        "refusals by reason | without Retry-After |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, runs in r["slo_mix"].items():
        for label in ("priorities", "slo_classes"):
            for cls, v in runs[label].items():
                lines.append(
                    f"| {name} | {label} | {cls} | {v['offered']} | {v['completed']} | "
                    f"{fmt(v['slo_attainment'])} | {v['refused']} | "
                    f"{v['refused_by_reason'] or '–'} | {v['refusals_without_retry_after']} |"
                )
    return lines
