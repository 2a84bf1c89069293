"""``kvgate bench agentic``: coding-agent sessions (AIPerf's agentic-coding trace) on a simulated
cluster, kvgate against round-robin and the peers at their defaults and tuned on the workload
(analytics/sim/agentictuned.py). Writes ``agentic.json`` (every number, the command beside it)
and ``agentic.md``.

The trace is replayed in **closed loop**: a session's next turn is sent its recorded delay (a
tool call, a person reading) after the previous turn ends, so a router that serves turns faster
gets more work through the same GPUs — tokens per second per GPU is the throughput the same
sessions reach, not the offered load. AIPerf's trace starts every session at 0 (AIPerf schedules
sessions when it runs): here session *k* starts at *k* / λ, λ the session rate whose turns offer
``load`` × the cluster's measured capacity (requests per second with every request queued).

kvgate runs as it does live at its defaults: with what the router does beside routing (pending
prefixes, its memory of recent prefills, pre-warming, the fit hold; ``acting_on``).

Per router and repetition (the simulator's seed; from the second repetition on each session's
start moves by up to 0.4 of the spacing): output tokens per second per GPU (completed requests'
output over the time from the first arrival to the last answer, per engine), tokens per second
per user (the median request's output over its decode time), the prefix-cache hit rate (cached
prompt tokens over prompt tokens), TTFT p50 / p99, the sessions whose turns' median TTFT is over
30 s (``slow_sessions``: who the tail is — a few sessions or everyone), and what was refused.
The criteria (issue: agentic traffic) compare medians over the repetitions;
``router_cpu_ms_per_request_100k`` is the live measurement of
``docs/benchmarks/longprompt.json`` (its own command).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from analytics.progress import status
from analytics.sim.agenticload import agentic_metrics, sessions_at_once, sessions_started
from analytics.sim.agenticreport import agentic_markdown
from analytics.sim.agenticsweep import sweep_concurrency
from analytics.sim.agentictuned import TunedRun, tune_peers
from analytics.sim.bench_targets import TUNED
from analytics.sim.cluster import simulate
from analytics.sim.onecache import PULL_PRIORITY
from analytics.sim.replay import capacity_rps, open_trace
from analytics.sim.simconfig import SimConfig, acting_on, node_profile
from analytics.sim.traces import Trace
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["PEERS", "TRACE", "agentic_metrics", "bench_agentic"]

TRACE = Path("traces/aiperf_agentic_code_100s_seed42.jsonl")
PEERS = ("sglang_cache_aware", "dynamo_cost", "llmd_weighted", "vllm_kv_aware", "vllm_prefix_aware")
TARGETS = {
    "tok_s_per_gpu_vs_rr": (">=", 1.25),
    "tok_s_per_user_vs_rr": (">=", 1.0),
    "hit_vs_best_peer": (">=", 1.0),
    "ttft_p99_vs_best_peer": ("<=", 0.9),
    "router_cpu_ms_per_request_100k": ("<=", 200.0),
}


UNCONTENDED = 8  # the bound's cluster: this many times the nodes, so that no turn waits
LARGER_KV_GIB = 140.4  # an H200's memory (141 GB) as CUDA reports it
POLICIES = ("round_robin", "kvgate", *PEERS)


def _session_rate(open_loop: Trace, cfg: SimConfig, load: float) -> tuple[float, float]:
    """The cluster's measured capacity (requests/s) and the session start rate whose turns
    offer ``load`` × that capacity."""
    cap = capacity_rps(open_loop, cfg)
    sessions = len({r.session_id for r in open_loop.requests})
    return cap, load * cap * sessions / len(open_loop.requests)


def _run(
    trace: Trace, policy: str | RouterSettings, cfg: SimConfig, nodes: int
) -> dict[str, float | int]:
    """One simulated run of ``policy`` (a name: at its defaults; kvgate as live)."""
    settings = RouterSettings(policy=policy) if isinstance(policy, str) else policy
    done = simulate(trace, make_policy(settings), acting_on(cfg, settings))
    return agentic_metrics(done, len(trace.requests), nodes)


def _each_once(trace: Trace, cfg: SimConfig, nodes: int, what: str) -> dict[str, Any]:
    """One run of every router on ``trace`` (``what``: the run's name in the progress line)."""
    out: dict[str, Any] = {}
    for policy in POLICIES:
        with status(f"agentic: {policy}, {what}"):
            out[policy] = _run(trace, policy, cfg, nodes)
    return out


def _uncontended(
    reps: list[Trace], base: SimConfig, nodes: int, rr: list[dict[str, Any]]
) -> dict[str, Any]:
    """The most any router can gain over round-robin in tokens per GPU on these sessions: each
    repetition's sessions on a cluster :data:`UNCONTENDED` × as large (kvgate's routing, the
    same engines), where every turn is served as it arrives and from its session's cache. Its
    span is the sessions' own pace — their recorded delays and each turn's service alone —
    which no router goes below on any number of these GPUs; tokens per GPU can rise over
    round-robin's (``rr``: its runs, repetition by repetition) by at most round-robin's span
    over it."""
    runs = []
    for rep, started_at in enumerate(reps):
        with status(f"agentic: uncontended #{rep + 1}"):
            big = replace(base, nodes=UNCONTENDED * nodes, seed=rep)
            runs.append({"seed": rep, **_run(started_at, "kvgate", big, UNCONTENDED * nodes)})
    bounds = [r["span_s"] / u["span_s"] for r, u in zip(rr, runs, strict=True)]
    return {
        "what": f"kvgate on {UNCONTENDED * nodes} nodes, the same sessions: no turn waits; "
        "round-robin's span over this one bounds tok_s_per_gpu_vs_rr",
        "nodes": UNCONTENDED * nodes,
        "tok_s_per_gpu_vs_rr_bound": round(statistics.median(bounds), 3),
        "bounds": [round(b, 3) for b in bounds],
        "runs": runs,
    }


def _larger_kv(
    trace: Trace, open_loop: Trace, base: SimConfig, load: float, nodes: int
) -> dict[str, Any]:
    """The same sessions at the same load on engines with an H200's memory (about twice the
    KV of an H100 beside the same weights; step times left at the H100's): how much of the
    comparison is the KV the contexts fight over. One run per router; capacity measured again
    on these engines."""
    profile = base.profile.model_copy(
        update={"gpu": "H200-SXM-141GB", "gpu_memory_gib": LARGER_KV_GIB}
    )
    big = replace(base, profile=profile)
    cap, rate = _session_rate(open_loop, big, load)
    out = _each_once(sessions_started(trace, rate, 0), big, nodes, "larger KV")
    return {
        "what": f"{load:.0%} load on engines with {LARGER_KV_GIB} GiB (an H200's memory; "
        "H100 step times), one run each",
        "kv_blocks_per_engine": profile.num_gpu_blocks,
        "capacity_rps": round(cap, 4),
        "runs": out,
    }


def _with_pulls(
    started: Trace,
    concurrent: Trace,
    base: SimConfig,
    nodes: int,
    open_runs: dict[str, dict[str, Any]],
    conc_runs: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """kvgate on engines that give and take a prefix's KV (router/decision/pull.py): a turn
    moved off a session's home that has no room for the rest of its context loads what the
    home holds instead of computing it again. The other routers never pull: their runs
    (``open_runs``: the first repetition's; ``conc_runs``) are the comparison."""
    cfg = replace(base, kv_pull=True)
    settings = RouterSettings(policy="kvgate", pull_priority=PULL_PRIORITY)
    out: dict[str, Any] = {
        "what": "kvgate on engines whose KV connectors give and take a prefix's KV (pulls; "
        f"router.pull_priority {PULL_PRIORITY}), against the same runs of the other routers "
        "(they never pull); one run each",
    }
    for name, trace, others in (
        ("open_loop", started, open_runs),
        ("at_concurrency", concurrent, conc_runs),
    ):
        with status(f"agentic: kvgate with pulls, {name}"):
            done = simulate(trace, make_policy(settings), acting_on(cfg, settings))
        run = {
            **agentic_metrics(done, len(trace.requests), nodes),
            "pulls": sum(d.reason == "kv_pull" for d in done),
        }
        out[name] = {**_versus({**others, "kvgate": run}), "kvgate": run}
    return out


def _versus(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """kvgate against round-robin and the best peers, in one set of figures per router (a
    run's, or the medians over the repetitions)."""
    kv, rr = runs["kvgate"], runs["round_robin"]
    peers = [p for p in runs if p.removesuffix(TUNED) in PEERS]  # defaults and tuned
    hit = max(runs[p]["hit_rate"] for p in peers)
    p99 = min(runs[p]["ttft_p99_s"] for p in peers)
    return {
        "tok_s_per_gpu_vs_rr": round(kv["tok_s_per_gpu"] / rr["tok_s_per_gpu"], 3),
        "tok_s_per_user_vs_rr": round(kv["tok_s_per_user"] / rr["tok_s_per_user"], 3),
        "hit_vs_best_peer": round(kv["hit_rate"] / hit, 3),
        "ttft_p99_vs_best_peer": round(kv["ttft_p99_s"] / p99, 3),
    }


def _live(path: Path) -> dict[str, Any] | None:
    """The live comparison's agentic workload (``livepeer.json``, its own command and date):
    the same sessions scaled down, through kvgate's router and sglang-router on simulated
    engines; None where it has not run."""
    if not path.exists():
        return None
    got = json.loads(path.read_text()).get("workloads", {}).get("agentic")
    if not got:
        return None
    keep = ("command", "date", "agentic", "num_gpu_blocks", "prefill_tokens_per_s", "duration_s")
    return {
        **{k: got.get(k) for k in keep},
        "repetitions": len(got.get("repetitions", ())),
        "medians": got.get("medians", {}),
        "checks": got.get("checks", []),
    }


def _unseeded(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "seed"}


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(float(r[key]) for r in runs))


def _criteria(
    med: dict[str, dict[str, Any]], cpu_path: Path
) -> tuple[dict[str, float | None], dict[str, bool], dict[str, Any]]:
    """The issue's figures from the medians and the live CPU measurement (``cpu_path``: its
    own benchmark's file, empty where it has not run), whether each is met, and that file."""
    cpu = json.loads(cpu_path.read_text()) if cpu_path.exists() else {}
    results: dict[str, float | None] = {
        **_versus(med),
        "router_cpu_ms_per_request_100k": cpu.get("router_cpu_ms_per_request_100k"),
    }
    met = {
        k: v is not None and (v >= t if op == ">=" else v <= t)
        for k, v in results.items()
        for op, t in [TARGETS[k]]
    }
    return results, met, cpu


def _at_concurrency(
    trace: Trace, concurrent: Trace, slots: int, base: SimConfig, nodes: int, tuned_run: TunedRun
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``concurrent``: ``trace`` with ``slots`` sessions at once (AIPerf's ``--concurrency``).
    Its section — every router once, the peers tuned again on this schedule (where the KV is
    oversubscribed other points win) — and the sweep of concurrencies around it."""
    runs = _each_once(concurrent, base, nodes, f"{slots} at once")
    tuned, tuning = tune_peers(PEERS, [concurrent], {p: [r] for p, r in runs.items()}, tuned_run)
    runs.update({p: _unseeded(rs[0]) for p, rs in tuned.items()})
    sweep = sweep_concurrency(
        len({r.session_id for r in trace.requests}),
        lambda k: sessions_at_once(trace, k),
        tuning,
        lambda t, settings: _run(t, settings, base, nodes),
        {slots: runs},
    )
    return {
        "what": f"{slots} sessions at once (AIPerf's --concurrency {slots}): a session starts "
        "when one ends",
        "sessions_at_once": slots,
        **_versus(runs),
        "runs": runs,
        "tuned": tuning,
    }, sweep


def bench_agentic(
    *,
    out_dir: Path,
    command: str,
    nodes: int = 8,
    load: float = 0.8,
    repetitions: int = 3,
    trace_path: Path = TRACE,
) -> dict[str, Any]:
    started = time.time()
    base = SimConfig(nodes=nodes)
    open_loop = open_trace(trace_path)
    # sessions start at the rate whose turns offer load × capacity requests per second
    cap, sessions_per_s = _session_rate(open_loop, base, load)
    trace: Trace = open_loop.looped(True)
    reps = [sessions_started(trace, sessions_per_s, rep) for rep in range(repetitions)]
    runs: dict[str, list[dict[str, Any]]] = {}
    for policy in POLICIES:
        for rep, started_at in enumerate(reps):
            with status(f"agentic: {policy} #{rep + 1}"):
                got = _run(started_at, policy, replace(base, seed=rep), nodes)
            runs.setdefault(policy, []).append({"seed": rep, **got})

    def tuned_run(t: Trace, settings: RouterSettings, rep: int) -> dict[str, Any]:
        return {"seed": rep, **_run(t, settings, replace(base, seed=rep), nodes)}

    tuned, tuning = tune_peers(PEERS, reps, runs, tuned_run)
    runs.update(tuned)
    # AIPerf's own schedule: all 100 sessions at once (its concurrency 100), the cluster
    # saturated; one run each (nothing to jitter)
    saturated = _each_once(trace, base, nodes, "all sessions at once")
    # AIPerf's way of loading a cluster: a number of sessions at once (here the load's share
    # of the trace's sessions), a new one started as one ends; one run each
    slots = max(1, round(load * len({r.session_id for r in trace.requests})))
    concurrent = sessions_at_once(trace, slots)
    at_concurrency, sweep = _at_concurrency(trace, concurrent, slots, base, nodes, tuned_run)
    larger = _larger_kv(trace, open_loop, base, load, nodes)
    floor = _uncontended(reps, base, nodes, runs["round_robin"])
    pulls = _with_pulls(
        reps[0],
        concurrent,
        base,
        nodes,
        {p: rs[0] for p, rs in runs.items()},
        at_concurrency["runs"],
    )
    med = {
        p: {k: _median(rs, k) for k in rs[0] if k != "seed" and isinstance(rs[0][k], int | float)}
        for p, rs in runs.items()
    }
    peers = [p for p in med if p.removesuffix(TUNED) in PEERS]  # defaults and tuned
    best_hit = max(peers, key=lambda p: med[p]["hit_rate"])
    best_ttft = min(peers, key=lambda p: med[p]["ttft_p99_s"])
    kv = node_profile(base, trace.block_size)
    live = _live(out_dir / "livepeer.json")
    results, met, cpu = _criteria(med, out_dir / "longprompt.json")
    report = {
        "command": command,
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": round(time.time() - started, 1),
        "trace": trace_path.name,
        "replay": "closed loop",
        "nodes": nodes,
        "load": load,
        "capacity_rps": round(cap, 4),
        "sessions_per_s": round(sessions_per_s, 5),
        "requests": len(trace.requests),
        "cluster_kv_tokens": nodes * kv.num_gpu_blocks * kv.block_size,
        "best_peer": {"hit_rate": best_hit, "ttft_p99_s": best_ttft},
        **results,
        "tok_s_per_gpu_vs_rr_bound": floor["tok_s_per_gpu_vs_rr_bound"],
        "router_cpu_command": cpu.get("command"),
        "targets": {k: f"{op} {t}" for k, (op, t) in TARGETS.items()},
        "met": met,
        "median": med,
        "runs": runs,
        "tuned": tuning,
        "all_sessions_at_once": {
            "what": "AIPerf's schedule: every session starts at 0 (the cluster saturated)",
            **_versus(saturated),
            "runs": saturated,
        },
        "at_concurrency": at_concurrency,
        "concurrency_sweep": sweep,
        "larger_kv": larger,
        "uncontended": floor,
        "with_pulls": pulls,
        "live": live,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "agentic.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "agentic.md").write_text(agentic_markdown(report))
    return report
