"""``kvgate plan``: how many replicas of a model on a GPU serve a workload at a rate within an SLO.

Per replica, the design's KV formula (``agents/catalog.py`` derives the engine profile from the
model's ``config.json`` and the GPU's datasheet): weights memory, KV bytes per token, KV blocks at
``gpu_memory_utilization``, and how many sequences of the workload's lengths fit at once.

The fleet size is found in the simulator, which runs the live router's policy code on engines of
that profile: the smallest replica count whose SLO attainment (share of requests within both the
TTFT and the TPOT target) reaches the target at the given rate. The count one fewer is shown beside
it, and round-robin's count for the same SLO: what cache-aware routing saves in GPUs.

The search doubles the count until the SLO is met, then bisects; every count it tried is kept,
so the answer ``n`` always comes with a simulated ``n − 1`` that missed (unless ``n`` is 1).
"""

from __future__ import annotations

import functools
import html
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agents.catalog import GPUS, MODELS, GpuSpec, ModelSpec, derive_profile, replica_gpus
from agents.profile import EngineProfile, attention_pairs
from analytics.sim.replay import replay_trace
from analytics.sim.simconfig import SimConfig
from analytics.sim.traces import Trace
from analytics.sim.workloads import WORKLOADS, make_workload
from router.settings import RouterSettings

__all__ = [
    "Slo",
    "at_rate",
    "batch_latency_s",
    "idle_ttft_s",
    "parse_slo",
    "plan",
    "profile_rows",
    "profile_table",
    "render_html",
    "render_text",
    "replica_figures",
    "router_for",
    "size_fleet",
]

BASELINE = "round_robin"
PLATEAU = 0.003  # doubling the fleet gains less attainment than this: the SLO is out of reach


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1
    attainment: float = 0.99  # share of requests that must meet both targets


def parse_slo(text: str) -> Slo:
    """``ttft=2,tpot=0.1[,attainment=0.99]`` (seconds; attainment a share or a percentage)."""
    values: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "attainment"):
            raise ValueError(f"bad SLO term {part!r}: use ttft=S,tpot=S[,attainment=P]")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"bad SLO value {raw!r} for {key}") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"SLO {key} must be positive")
        if key == "attainment" and value > 1:
            value /= 100.0
        if key == "attainment" and value > 1:
            raise ValueError("attainment is at most 100 %")
        values[key] = value
    return Slo(values.get("ttft", 2.0), values.get("tpot", 0.1), values.get("attainment", 0.99))


def at_rate(source: str | Trace, rate: float, requests: int, seed: int = 0) -> tuple[Trace, float]:
    """The traffic at ``rate`` requests/s, and the warm-up (seconds) to leave out of the
    measurement.

    A generated workload is generated at that rate, its think times real. Conversations take
    minutes to reach the steady state (a session's later turns arrive long after its first), so
    the trace starts with a warm-up as long as most sessions (their 90th-percentile span), then
    ``requests`` measured requests; the warm-up runs too, filling the caches as the earlier turns
    of a real fleet would have. A trace file's arrivals are rescaled to the rate, no warm-up."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError("rate must be positive")
    if not isinstance(source, str):
        trace = source.head(requests)
        if len(trace.requests) < 2 or trace.span_s <= 0:
            raise ValueError("the trace needs at least two requests at different times")
        own = (len(trace.requests) - 1) / trace.span_s
        return trace.scaled(own / rate), 0.0
    if source not in WORKLOADS:
        raise ValueError(f"unknown workload {source!r}; known: {', '.join(WORKLOADS)}")
    probe = make_workload(source, requests=requests, rate=rate, seed=seed)
    spans: dict[str, list[float]] = {}
    for r in probe.requests:
        if r.session_id is not None:
            spans.setdefault(r.session_id, []).append(r.arrival_s)
    durations = sorted(max(v) - min(v) for v in spans.values())
    warmup = durations[int(0.9 * (len(durations) - 1))] if durations else 0.0
    if warmup <= 0:
        return probe, 0.0
    end = warmup + requests / rate

    def window(gen_rate: float) -> tuple[Trace, float]:
        # sessions that start before ``end`` and their turns: enough requests to cover it
        n = int(gen_rate * (end + warmup)) + requests
        full = make_workload(source, requests=n, rate=gen_rate, seed=seed)
        t0 = full.requests[0].arrival_s
        kept = tuple(r for r in full.requests if r.arrival_s - t0 < end)
        measured = sum(1 for r in kept if r.arrival_s - t0 >= warmup) / (end - warmup)
        return Trace(full.name, full.block_size, kept), measured

    # sessions that end early (context cap) make fewer turns than the generator's mean:
    # generate once more at the rate that corrects for it
    trace, measured = window(rate)
    if measured > 0 and abs(measured - rate) > 0.02 * rate:
        trace, _ = window(rate * rate / measured)
    return trace, warmup


def replica_figures(profile: EngineProfile, tp: int, trace: Trace) -> dict[str, Any]:
    """One replica's memory and what fits in it, at the traffic's lengths."""
    lengths = sorted(r.prompt_tokens + r.output_tokens for r in trace.requests)
    mean = statistics.fmean(lengths)
    p95 = lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))]
    kv_tokens = profile.num_gpu_blocks * profile.block_size
    kv_per_gpu = profile.kv_memory_gib
    return {
        "gpus": tp,
        "weights_gib": round(profile.weights_gib * tp, 2),
        "weights_gib_per_gpu": round(profile.weights_gib, 2),
        "kv_bytes_per_token": profile.kv_bytes_per_token * tp,
        "kv_bytes_per_token_per_gpu": profile.kv_bytes_per_token,
        "kv_memory_gib_per_gpu": round(kv_per_gpu, 2),
        "kv_blocks": profile.num_gpu_blocks,
        "block_size": profile.block_size,
        "kv_tokens": kv_tokens,
        "mean_sequence_tokens": round(mean, 1),
        "p95_sequence_tokens": p95,
        "max_concurrent_at_mean": min(profile.max_num_seqs, int(kv_tokens // mean)),
        "max_concurrent_at_p95": min(profile.max_num_seqs, kv_tokens // max(1, p95)),
        "max_num_seqs": profile.max_num_seqs,
    }


def router_for(profile: EngineProfile, policy: str) -> RouterSettings:
    """The router settings an operator would run with these engines: the policy, and kvgate's
    cost model told the engines' step times and prefill rate (its defaults are an H100's)."""
    cost = {
        "prefill_tokens_per_s": profile.prefill_tokens_per_s,
        "step_base_s": profile.step_base_s,
        "step_per_seq_s": profile.step_per_seq_s,
        "step_per_context_token_s": profile.step_per_context_token_s,
    }
    return RouterSettings.model_validate({"policy": policy, "cost": cost})


def _evaluate(
    trace: Trace,
    warmup: float,
    profile: EngineProfile,
    policy: str,
    slo: Slo,
    nodes: int,
    *,
    seed: int,
) -> dict[str, Any]:
    out = replay_trace(
        trace,
        nodes=nodes,
        policy=router_for(profile, policy),
        load=None,
        seed=seed,
        cfg=SimConfig(profile=profile),
        ttft_slo_s=slo.ttft_s,
        tpot_slo_s=slo.tpot_s,
        measure_from_s=warmup,
    )
    keep = ("slo_attainment", "hit_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
    return {"replicas": nodes, "measured": out.get("requests"), **{k: out.get(k) for k in keep}}


def size_fleet(
    evaluate: Callable[[int], dict[str, Any]], target: float, max_replicas: int
) -> tuple[int | None, dict[int, dict[str, Any]]]:
    """The smallest count whose ``slo_attainment`` ≥ ``target`` (doubling, then bisection),
    and every count evaluated. ``None`` when no count up to ``max_replicas`` meets it, or when
    doubling the fleet stops helping (the requests' own service time misses the SLO: more
    replicas cannot fix it)."""
    tried: dict[int, dict[str, Any]] = {}

    def attained(n: int) -> float:
        if n not in tried:
            tried[n] = evaluate(n)
        return float(tried[n]["slo_attainment"] or 0.0)

    hi = 1
    while attained(hi) < target:
        if hi >= max_replicas:
            return None, tried
        nxt = min(max_replicas, hi * 2)
        if hi >= 4 and attained(nxt) < attained(hi) + PLATEAU:
            return None, tried
        hi = nxt
    lo = hi // 2  # missed (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attained(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi, tried


def plan(
    model: ModelSpec,
    gpu: GpuSpec,
    source: str | Trace,
    *,
    rate: float,
    slo: Slo,
    tp: int | None = None,
    policy: str = "kvgate",
    baseline: str = BASELINE,
    requests: int = 2000,
    max_replicas: int = 256,
    seed: int = 0,
) -> dict[str, Any]:
    """The whole plan: per-replica figures, the fleet size for ``policy`` and for ``baseline``."""
    tp = tp or replica_gpus(model, gpu)
    profile = derive_profile(model, gpu, tp)
    trace, warmup = at_rate(source, rate, requests, seed)
    sides: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys((policy, baseline)):
        size, tried = size_fleet(
            functools.partial(_evaluate, trace, warmup, profile, name, slo, seed=seed),
            slo.attainment,
            max_replicas,
        )
        best = max(tried.values(), key=lambda t: t["slo_attainment"] or 0.0)
        sides[name] = {
            "replicas": size,
            "best_attainment": best["slo_attainment"],
            "gpus": size * tp if size is not None else None,
            "at_size": tried.get(size) if size is not None else None,
            "one_fewer": tried.get(size - 1) if size is not None and size > 1 else None,
            "tried": [tried[n] for n in sorted(tried)],
        }
    ours, theirs = sides[policy]["replicas"], sides[baseline]["replicas"]
    saved = theirs - ours if ours is not None and theirs is not None else None
    return {
        "model": model.name,
        "gpu": gpu.name,
        "tp": tp,
        "traffic": trace.name,
        "requests": len(trace.requests),
        "warmup_s": round(warmup, 1),
        "rate_rps": rate,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
        "replica": replica_figures(profile, tp, trace),
        "profile": profile.model_dump(),
        "policy": policy,
        "baseline": baseline,
        "fleet": sides,
        "replicas_saved": saved,
        "gpus_saved": saved * tp if saved is not None else None,
    }


def _pct(v: Any) -> str:
    return f"{v:.1%}" if isinstance(v, float) else "–"


def _secs(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else "–"


def _fleet_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = [["routing", "replicas", "GPUs", "SLO attainment", "hit rate", "TTFT p99 (s)"]]
    for name, side in report["fleet"].items():
        for label, key in (("", "at_size"), (" (one fewer)", "one_fewer")):
            r = side[key]
            if r is None:
                continue
            rows.append(
                [
                    name + label,
                    str(r["replicas"]),
                    str(r["replicas"] * report["tp"]),
                    _pct(r["slo_attainment"]),
                    _pct(r["hit_rate"]),
                    _secs(r["ttft_p99_s"]),
                ]
            )
        if side["replicas"] is None:
            rows.append([name, "> max", "–", "–", "–", "–"])
    return rows


def _replica_rows(report: dict[str, Any]) -> list[list[str]]:
    r = report["replica"]
    return [
        ["per replica", "value"],
        ["GPUs (tensor parallel)", str(r["gpus"])],
        ["weights", f"{r['weights_gib']} GiB ({r['weights_gib_per_gpu']} GiB per GPU)"],
        ["KV bytes per token", f"{r['kv_bytes_per_token']:,} B"],
        ["KV memory per GPU", f"{r['kv_memory_gib_per_gpu']} GiB"],
        ["KV blocks", f"{r['kv_blocks']:,} × {r['block_size']} tokens = {r['kv_tokens']:,}"],
        [
            "sequence length (prompt + output)",
            f"mean {r['mean_sequence_tokens']:,.0f}, p95 {r['p95_sequence_tokens']:,}",
        ],
        [
            "concurrent sequences that fit",
            f"{r['max_concurrent_at_mean']} at the mean, {r['max_concurrent_at_p95']} at p95 "
            f"(max_num_seqs {r['max_num_seqs']})",
        ],
    ]


def _headline(report: dict[str, Any]) -> str:
    s = report["slo"]
    ours = report["fleet"][report["policy"]]["replicas"]
    theirs = report["fleet"][report["baseline"]]["replicas"]
    head = (
        f"{report['model']} on {report['tp']} × {report['gpu']} per replica; "
        f"{report['traffic']} at {report['rate_rps']:g} req/s ({report['requests']} requests); "
        f"SLO TTFT ≤ {s['ttft_s']:g} s and TPOT ≤ {s['tpot_s']:g} s for "
        f"{s['attainment']:.1%} of requests."
    )
    if ours is None:
        best = report["fleet"][report["policy"]]["best_attainment"] or 0.0
        return head + (
            f" No fleet meets it: the best simulated attainment is {best:.1%} (more replicas "
            "stopped helping, or the search limit was reached)."
        )
    tail = f" {report['policy']}: {ours} replicas ({ours * report['tp']} GPUs)"
    if theirs is not None:
        tail += f"; {report['baseline']}: {theirs} replicas ({theirs * report['tp']} GPUs)"
    return head + tail + "."


def render_text(report: dict[str, Any]) -> str:
    lines = [_headline(report), ""]
    for rows in (_replica_rows(report), _fleet_rows(report)):
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def render_html(report: dict[str, Any]) -> str:
    from analytics.htmlpage import page, png_b64, pyplot, table

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, side in report["fleet"].items():
        pts = sorted((t["replicas"], t["slo_attainment"] or 0.0) for t in side["tried"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    ax.axhline(report["slo"]["attainment"], color="#888", ls="--", lw=1, label="target")
    ax.set_xlabel("replicas")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.02)
    ax.legend()
    body = (
        f"<p>{html.escape(_headline(report))}</p>"
        + table(_replica_rows(report))
        + table(_fleet_rows(report))
    )
    plots = [("SLO attainment against fleet size (every count simulated)", png_b64(fig))]
    return page("kvgate capacity plan", body, plots)


def idle_ttft_s(profile: EngineProfile, prompt_tokens: int) -> float:
    """TTFT of one prompt alone on an idle replica: its chunked prefill, step by step."""
    return batch_latency_s(profile, 1, prompt_tokens, 1) if prompt_tokens > 0 else 0.0


def batch_latency_s(
    profile: EngineProfile, batch: int, prompt_tokens: int, output_tokens: int
) -> float:
    """End-to-end time of ``batch`` equal requests started together on an idle replica (what
    vLLM's ``benchmark_latency`` measures): the prompts prefilled within the step's token budget
    (the step that completes them samples the first token), then one decode step per further
    output token with every sequence's context growing by one."""
    if batch < 1 or prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("batch, prompt_tokens and output_tokens must be positive")
    total = 0.0
    done = [0] * batch
    while done[-1] < prompt_tokens:
        budget, tokens, pairs = profile.max_num_batched_tokens, 0, 0
        for i in range(batch):
            n = min(budget - tokens, prompt_tokens - done[i])
            if n <= 0:
                continue
            pairs += attention_pairs(done[i], n)
            done[i] += n
            tokens += n
        total += profile.step_time_s(0, 0, tokens, pairs)
    for step in range(1, output_tokens):
        total += profile.step_time_s(batch, batch * (prompt_tokens + step), 0)
    return total


def profile_rows() -> list[dict[str, Any]]:
    """Every model on every GPU, at the fewest GPUs per replica that fit it."""
    rows: list[dict[str, Any]] = []
    for m in MODELS:
        for g in GPUS:
            try:
                tp = replica_gpus(m, g)
            except ValueError:
                continue
            p = derive_profile(m, g, tp)
            rows.append(
                {
                    "model": m.alias,
                    "gpu": g.alias,
                    "tp": tp,
                    "weights_gib_per_gpu": round(p.weights_gib, 1),
                    "kv_bytes_per_token": p.kv_bytes_per_token * tp,
                    "kv_tokens": p.num_gpu_blocks * p.block_size,
                    "itl_batch1_ms": round(p.step_time_s(1, 1024, 0) * 1e3, 2),
                    "itl_batch64_ms": round(p.step_time_s(64, 64 * 2048, 0) * 1e3, 2),
                    "prefill_tokens_per_s": round(p.prefill_tokens_per_s),
                    "ttft_8k_s": round(idle_ttft_s(p, 8192), 3),
                    "ttft_32k_s": round(idle_ttft_s(p, 32768), 3),
                }
            )
    return rows


def profile_table() -> str:
    """:func:`profile_rows` as aligned text."""
    rows = profile_rows()
    head = list(rows[0])
    cells = [head] + [
        [f"{r[k]:,}" if isinstance(r[k], int) else str(r[k]) for k in head] for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)
