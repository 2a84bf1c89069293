"""``preemption`` of ``kvgate bench fleet``: a batch tenant (low priority: sheddable) keeps the
pool busy with long prompts; a third of the way in an interactive tenant (high priority, SLO
class ``interactive``: 2 s TTFT) starts a surge on top. With preemption (admission/preempt.py,
the rule the live gate applies) an interactive request that would miss its deadline in the
admission queue takes the room of batch requests that have no first token yet — they get 503
``preempted`` and come back after Retry-After; without it (``admission.preemption`` off) the
interactive requests wait behind the batch work already admitted. Per tenant: what was offered,
served and refused (by reason), the interactive TTFT and SLO attainment, and the batch work the
preemptions cost."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

from admission.settings import AdmissionSettings
from agents.profile import EngineProfile
from analytics.sim.admission import Refused
from analytics.sim.cluster import simulate
from analytics.sim.metrics import pct
from analytics.sim.replay import at_load, capacity_rps
from analytics.sim.simconfig import RetryModel, SimConfig, with_router
from analytics.sim.traces import Trace, TraceRequest
from analytics.sim.workloads import long_prompts, shared_prompt
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["preempt_section", "preemption"]

KV_BLOCKS = 3000  # per node: KV binds before compute (a large model on few GPUs)
PREFILL = 5000.0  # its prefill, tokens per second


def _mixed(cfg: SimConfig, requests: int, batch_load: float, burst: int, burst_s: float) -> Trace:
    """Batch (long prompts, low) at ``batch_load`` × its capacity over the whole run; halfway
    through, ``burst`` interactive requests (shared prompts, high) within ``burst_s``."""
    batch0 = long_prompts(requests, 10.0, seed=7)
    batch = at_load(batch0, batch_load, capacity_rps(batch0, cfg))
    chat0 = shared_prompt(burst, 10.0, seed=8)
    start = batch.requests[0].arrival_s + batch.span_s / 2
    out: list[TraceRequest] = [replace(r, priority="low", client="batch") for r in batch.requests]
    t0, span = chat0.requests[0].arrival_s, max(1e-9, chat0.span_s)
    for r in chat0.requests:
        at = start + (r.arrival_s - t0) / span * burst_s
        out.append(replace(r, arrival_s=at, priority="high", client="app", slo_class="interactive"))
    out.sort(key=lambda r: r.arrival_s)
    return Trace("batch+burst", batch.block_size, tuple(out))


def _tenant(trace: Trace, done: list[Any], refused: list[Refused], client: str) -> dict[str, Any]:
    mine = [d for d in done if d.request.client == client]
    idx = {i for i, r in enumerate(trace.requests) if r.client == client}
    gone = [r for r in refused if r.index in idx]
    ttft = [d.first_token_s - d.request.arrival_s for d in mine]
    offered = len(idx)
    return {
        "offered": offered,
        "served": len(mine),
        "refused": sum(1 for r in gone if r.final),
        "refused_by_reason": dict(Counter(str(r.reason) for r in gone if r.final)),
        "preempted": sum(1 for r in gone if str(r.reason) == "preempted"),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "ttft_within_2s_of_offered": round(sum(t <= 2.0 for t in ttft) / offered, 4)
        if offered
        else None,
        "tokens_served": sum(d.request.prompt_tokens + d.request.output_tokens for d in mine),
    }


def preemption(
    *,
    nodes: int = 4,
    requests: int = 3000,
    batch_load: float = 1.5,
    burst: int = 120,
    burst_s: float = 4.0,
    kv_blocks: int = KV_BLOCKS,
) -> dict[str, Any]:
    profile = EngineProfile(num_gpu_blocks_override=kv_blocks, prefill_tokens_per_s=PREFILL)
    base = SimConfig(nodes=nodes, profile=profile)
    trace = _mixed(base, requests, batch_load, burst, burst_s)
    settings = RouterSettings(policy="kvgate")
    out: dict[str, Any] = {
        "nodes": nodes,
        "requests": len(trace.requests),
        "batch_load": batch_load,
        "burst": burst,
        "burst_s": burst_s,
        "kv_blocks_per_node": kv_blocks,
    }
    for label, on in (("preemption", True), ("without", False)):
        adm = AdmissionSettings(preemption=on)
        cfg = with_router(replace(base, admission=adm, retries=RetryModel()), settings)
        refused: list[Refused] = []
        done = simulate(trace, make_policy(settings), cfg, refused_out=refused)
        out[label] = {c: _tenant(trace, done, refused, c) for c in ("app", "batch")}
    return out


def preempt_section(r: dict[str, Any]) -> list[str]:
    p = r.get("preemption")
    if not p:
        return []
    lines = [
        "",
        "## Preemption of sheddable work (`preemption`)",
        "",
        f"{p['nodes']} nodes of {p['kv_blocks_per_node']} KV blocks; a batch tenant (low "
        f"priority, ~6k-token prompts) at {p['batch_load']:g}× capacity throughout; halfway, "
        f"{p['burst']} interactive requests (high, 2 s TTFT) within {p['burst_s']:g} s; "
        "refused clients retry after Retry-After (4 attempts).",
        "",
        "| run | tenant | offered | served | refused (final) | preempted | TTFT p50 / p99 (s) "
        "| TTFT ≤ 2 s of offered |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label in ("preemption", "without"):
        for c in ("app", "batch"):
            t = p[label][c]
            lines.append(
                f"| {label} | {c} | {t['offered']} | {t['served']} | {t['refused']} "
                f"| {t['preempted']} | {t['ttft_p50_s']} / {t['ttft_p99_s']} "
                f"| {t['ttft_within_2s_of_offered']} |"
            )
    return lines
