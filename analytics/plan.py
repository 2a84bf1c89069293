"""``kvgate plan``: how many replicas of a model on a GPU serve a workload at a rate within an SLO.

Per replica, the design's KV formula (``agents/catalog.py`` derives the engine profile from the
model's ``config.json`` and the GPU's datasheet): weights memory, KV bytes per token, KV blocks at
``gpu_memory_utilization``, and how many sequences of the workload's lengths fit at once.

The fleet size is found in the simulator, which runs the live router's policy code on engines of
that profile: the smallest replica count whose SLO attainment (share of requests within both the
TTFT and the TPOT target) reaches the target at the given rate. The count one fewer is shown beside
it, and round-robin's count for the same SLO: what cache-aware routing saves in GPUs.

The search (analytics/fleetsize.py) starts from an analytic estimate, brackets the answer and
bisects; every count it tried is kept, so the answer ``n`` always comes with a simulated ``n − 1``
that missed (unless ``n`` is 1), and the report says what that one misses.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agents.catalog import GPUS, MODELS, GpuSpec, ModelSpec, derive_profile, replica_gpus
from agents.profile import EngineProfile, idle_ttft_s
from analytics.fleetsize import alone, estimate_replicas, size_fleet
from analytics.sim.replay import replay_trace
from analytics.sim.simconfig import SimConfig
from analytics.sim.traces import Trace
from analytics.sim.workloads import WORKLOADS, make_workload
from router.settings import RouterSettings

__all__ = [
    "Slo",
    "at_rate",
    "parse_slo",
    "plan",
    "profile_rows",
    "profile_table",
    "replica_figures",
    "router_for",
]

BASELINE = "round_robin"
# the warm-up keeps the whole traffic of its last FULL_LOAD × the measured requests (at least
# FULL_LOAD_MIN), and only the measured sessions' turns before that
FULL_LOAD, FULL_LOAD_MIN = 8, 4000
# the share of requests that meet the SLO alone on an idle replica is this far below the
# target: no fleet meets it, and none is simulated (closer, the simulation decides)
ALONE_MARGIN = 0.005


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
    return _lean_warmup(trace, warmup, requests), warmup


def _lean_warmup(trace: Trace, warmup: float, requests: int) -> Trace:
    """The warm-up a fleet's state depends on: the earlier turns of every session measured
    (their prefixes are what the measured turns find cached) and the whole traffic of the last
    :data:`FULL_LOAD` × ``requests`` arrivals before the measurement (queues in their steady
    state, caches under the traffic's pressure). The other warm-up requests — sessions that
    ended before the measurement started — change neither, and at hundreds of requests per
    second they were nine tenths of the simulation. The first request keeps its time, so the
    measurement starts ``warmup`` after it as before."""
    if not trace.requests or warmup <= 0:
        return trace
    t0 = trace.requests[0].arrival_s
    start = t0 + warmup
    before = [r for r in trace.requests if r.arrival_s < start]
    full = max(FULL_LOAD_MIN, FULL_LOAD * requests)
    if len(before) <= full:
        return trace
    loaded_from = before[-full].arrival_s
    measured = {r.session_id for r in trace.requests if r.arrival_s >= start}
    kept = tuple(
        r
        for i, r in enumerate(trace.requests)
        if i == 0
        or r.arrival_s >= loaded_from
        or (r.session_id is not None and r.session_id in measured)
    )
    return Trace(trace.name, trace.block_size, kept)


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
    keep = (
        "slo_attainment",
        "ttft_attainment",
        "tpot_attainment",
        "refused",
        "hit_rate",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
    )
    return {"replicas": nodes, "measured": out.get("requests"), **{k: out.get(k) for k in keep}}


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
    max_gpus: int | None = None,
    seed: int = 0,
    progress: Callable[[str, int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The whole plan: per-replica figures, the fleet size for ``policy`` and for ``baseline``
    (``progress`` is told each fleet simulated: the routing, the replicas, the result)."""
    started = time.perf_counter()
    tp = tp or replica_gpus(model, gpu)
    profile = derive_profile(model, gpu, tp)
    if max_gpus is not None:
        if max_gpus < tp:
            raise ValueError(f"--max-gpus {max_gpus} is less than one replica's {tp} GPUs")
        max_replicas = min(max_replicas, max_gpus // tp)
    trace, warmup = at_rate(source, rate, requests, seed)
    measured = trace.since(warmup)
    estimate = start = min(
        max_replicas, estimate_replicas(profile, trace, rate, slo.tpot_s, warmup)
    )
    floor = alone(profile, trace, slo.ttft_s, slo.tpot_s, warmup)
    sides: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys((policy, baseline)):
        if floor["both"] < slo.attainment - ALONE_MARGIN:  # out of reach of any fleet
            sides[name] = {"replicas": None, "why": "alone", "best_attainment": None}
            sides[name].update(gpus=None, at_size=None, one_fewer=None, tried=[])
            continue
        told = None if progress is None else functools.partial(progress, name)
        sized = size_fleet(
            functools.partial(_evaluate, trace, warmup, profile, name, slo, seed=seed),
            slo.attainment,
            max_replicas,
            start=start,
            progress=told,
        )
        size, tried = sized.replicas, sized.tried
        best = max(tried.values(), key=lambda t: t["slo_attainment"] or 0.0)
        sides[name] = {
            "replicas": size,
            "why": sized.why,
            "best_attainment": best["slo_attainment"],
            "gpus": size * tp if size is not None else None,
            "at_size": tried.get(size) if size is not None else None,
            "one_fewer": tried.get(size - 1) if size is not None and size > 1 else None,
            "tried": [tried[n] for n in sorted(tried)],
        }
        if size is not None:  # the baseline's search starts where this one ended
            start = size
    ours, theirs = sides[policy]["replicas"], sides[baseline]["replicas"]
    saved = theirs - ours if ours is not None and theirs is not None else None
    return {
        "model": model.name,
        "gpu": gpu.name,
        "tp": tp,
        "traffic": trace.name,
        "requests": len(measured.requests),
        "simulated_requests": len(trace.requests),
        "warmup_s": round(warmup, 1),
        "rate_rps": rate,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
        "replica": replica_figures(profile, tp, measured),
        "alone": floor,
        "profile": profile.model_dump(),
        "policy": policy,
        "baseline": baseline,
        "fleet": sides,
        "replicas_saved": saved,
        "gpus_saved": saved * tp if saved is not None else None,
        "search": {
            "start": estimate,
            "max_replicas": max_replicas,
            "simulations": sum(len(side["tried"]) for side in sides.values()),
            "seconds": round(time.perf_counter() - started, 1),
        },
    }


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
