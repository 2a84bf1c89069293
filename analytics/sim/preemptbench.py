"""``preemption`` of ``kvgate bench fleet``: a batch tenant (low priority: sheddable) keeps a
pool busy with long documents (prompts around 16k tokens, on engines that prefill 10k tokens a
second); halfway through, an interactive tenant (high priority, SLO class ``interactive``: 2 s
TTFT) sends a burst. With preemption (admission/preempt.py, the rules the live router applies)
an interactive request that would miss its TTFT behind the batch prefill queued on its best node
— or would wait past its deadline in the admission queue — takes the place of batch requests
that have no first token yet: they get 503 ``preempted`` and come back after Retry-After.
Without it (``admission.preemption`` off) the interactive requests are refused early (429
``deadline``). Per tenant and run: what was offered, served and refused (by reason), the
preemptions, TTFT and the share of the offered served within 2 s; three trace seeds."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

from admission.core import RejectReason
from admission.settings import AdmissionSettings
from agents.profile import EngineProfile
from analytics.sim.admission import Refused
from analytics.sim.cluster import simulate
from analytics.sim.metrics import pct
from analytics.sim.replay import at_load, capacity_rps
from analytics.sim.simconfig import Done, RetryModel, SimConfig, with_router
from analytics.sim.traces import Trace, TraceRequest
from analytics.sim.workloads import long_prompts, shared_prompt
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["preempt_section", "preemption"]

KV_BLOCKS = 6000  # per node: 96k tokens, six of the batch documents
PREFILL = 10_000.0  # tokens per second: a large model's prefill
SEEDS = (7, 17, 27)
LABELS = ("preemption", "without")


def _mixed(
    cfg: SimConfig, requests: int, batch_load: float, burst: int, burst_s: float, seed: int
) -> Trace:
    """Batch (long prompts, low) at ``batch_load`` × its capacity over the whole run; halfway
    through, ``burst`` interactive requests (shared prompts, high) within ``burst_s``."""
    batch0 = long_prompts(requests, 10.0, seed=seed)
    batch = at_load(batch0, batch_load, capacity_rps(batch0, cfg))
    chat0 = shared_prompt(burst, 10.0, seed=seed + 1)
    start = batch.requests[0].arrival_s + batch.span_s / 2
    out: list[TraceRequest] = [replace(r, priority="low", client="batch") for r in batch.requests]
    t0, span = chat0.requests[0].arrival_s, max(1e-9, chat0.span_s)
    for r in chat0.requests:
        at = start + (r.arrival_s - t0) / span * burst_s
        out.append(replace(r, arrival_s=at, priority="high", client="app", slo_class="interactive"))
    out.sort(key=lambda r: r.arrival_s)
    return Trace("batch+burst", batch.block_size, tuple(out))


def _tenant(trace: Trace, done: list[Done], refused: list[Refused], client: str) -> dict[str, Any]:
    mine = [d for d in done if d.request.client == client]
    idx = {i for i, r in enumerate(trace.requests) if r.client == client}
    gone = [r for r in refused if r.index in idx]
    ttft = [d.first_token_s - d.request.arrival_s for d in mine]
    p50, p99 = pct(ttft, 0.5), pct(ttft, 0.99)
    return {
        "offered": len(idx),
        "served": len(mine),
        "refused": sum(1 for r in gone if r.final),
        "refused_by_reason": dict(Counter(str(r.reason) for r in gone if r.final)),
        "preempted": sum(1 for r in gone if r.reason == RejectReason.PREEMPTED),
        "ttft_p50_s": None if p50 is None else round(p50, 3),
        "ttft_p99_s": None if p99 is None else round(p99, 3),
        "within_2s_of_offered": round(sum(t <= 2.0 for t in ttft) / len(idx), 4) if idx else None,
        "tokens_served": sum(d.request.prompt_tokens + d.request.output_tokens for d in mine),
    }


def preemption(
    *,
    nodes: int = 4,
    requests: int = 1500,
    batch_load: float = 1.5,
    burst: int = 240,
    burst_s: float = 20.0,
    seeds: tuple[int, ...] = SEEDS,
) -> dict[str, Any]:
    profile = EngineProfile(num_gpu_blocks_override=KV_BLOCKS, prefill_tokens_per_s=PREFILL)
    base = SimConfig(nodes=nodes, profile=profile)
    settings = RouterSettings(policy="kvgate")
    runs = []
    for seed in seeds:
        trace = _mixed(base, requests, batch_load, burst, burst_s, seed)
        row: dict[str, Any] = {"seed": seed}
        for label, on in zip(LABELS, (True, False), strict=True):
            adm = AdmissionSettings(preemption=on)
            cfg = with_router(replace(base, admission=adm, retries=RetryModel()), settings)
            refused: list[Refused] = []
            done = simulate(trace, make_policy(settings), cfg, refused_out=refused)
            row[label] = {c: _tenant(trace, done, refused, c) for c in ("app", "batch")}
        runs.append(row)

    def spread(label: str, client: str, key: str) -> list[Any]:
        return sorted(r[label][client][key] for r in runs)

    return {
        "nodes": nodes,
        "kv_blocks_per_node": KV_BLOCKS,
        "prefill_tokens_per_s": PREFILL,
        "batch_requests": requests,
        "batch_load": batch_load,
        "burst": burst,
        "burst_s": burst_s,
        "runs": runs,
        "app_within_2s": {
            lbl: spread(lbl, "app", "within_2s_of_offered") for lbl in ("preemption", "without")
        },
        "batch_served": {lbl: spread(lbl, "batch", "served") for lbl in ("preemption", "without")},
        "batch_preempted": spread("preemption", "batch", "preempted"),
    }


def preempt_section(r: dict[str, Any]) -> list[str]:
    p = r.get("preemption")
    if not p or "runs" not in p:
        return []
    lines = [
        "",
        "## Preemption of sheddable work (`preemption`)",
        "",
        f"{p['nodes']} nodes of {p['kv_blocks_per_node']} KV blocks prefilling "
        f"{p['prefill_tokens_per_s']:g} tokens/s; a batch tenant (low priority, prompts around "
        f"16k tokens) at {p['batch_load']:g}× capacity throughout; halfway, {p['burst']} "
        f"interactive requests (high, 2 s TTFT) within {p['burst_s']:g} s; refused clients "
        "retry after Retry-After (4 attempts). Interactive requests served within 2 s, of those "
        f"offered (per seed, sorted): {p['app_within_2s']['preemption']} with preemption, "
        f"{p['app_within_2s']['without']} without; batch requests served "
        f"{p['batch_served']['preemption']} with, {p['batch_served']['without']} without "
        f"({p['batch_preempted']} preempted).",
        "",
        "| seed | run | tenant | offered | served | refused (final) | preempted "
        "| TTFT p50 / p99 (s) | ≤ 2 s of offered |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in p["runs"]:
        for label in ("preemption", "without"):
            for c in ("app", "batch"):
                t = run[label][c]
                lines.append(
                    f"| {run['seed']} | {label} | {c} | {t['offered']} | {t['served']} "
                    f"| {t['refused']} {t['refused_by_reason'] or ''} | {t['preempted']} "
                    f"| {t['ttft_p50_s']} / {t['ttft_p99_s']} | {t['within_2s_of_offered']} |"
                )
    return lines
