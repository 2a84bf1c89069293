"""``kvgate bench routing``: every policy on the same simulated cluster and workloads, same run.

For each workload (the public traces and the generated ones) the cluster's capacity is measured
once (:func:`analytics.sim.replay.capacity_rps`, saturated throughput) and every policy replays
the same requests at each load. Writes ``routing.json`` (every number), ``routing.md`` (tables,
the targets and whether they are met) and PNG plots (TTFT p99 and hit rate against load).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from analytics.progress import status, tracked
from analytics.sim.bench_targets import (
    SPEED_TARGET,
    TUNED,
    conversation_targets,
    speed_targets,
    targets,
)
from analytics.sim.cluster import SimConfig
from analytics.sim.replay import bounds_at, capacity_rps, open_trace, replay_trace
from router.policies import POLICIES, TUNING_GRID, grid_points
from router.settings import RouterSettings

__all__ = ["bench_routing", "reuse"]

KEYS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p99_s",
    "e2e_p99_s",
    "hit_rate",
    "hit_bound",
    "hit_bound_causal",
    "hit_bound_pooled_lru",
    "slo_attainment",
    "load_cov",
    "max_over_mean_load",
    "throughput_rps",
    "goodput_rps",
)
TUNE_LOAD = 0.8  # the load the peers are tuned at (the targets' load)
SPEED_RUNS = 3


def _one(args: tuple[str, int | None, int, str | RouterSettings, float, float]) -> dict[str, Any]:
    source, limit, nodes, policy, load, cap = args
    trace = open_trace(source, limit=limit)
    return replay_trace(trace, nodes=nodes, policy=policy, load=load, capacity=cap)


def _params(r: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """A run's peer parameters, its defaults' when it ran without any."""
    params = r.get("policy_params") or (
        grid_points(r["policy"])[0] if r["policy"] in TUNING_GRID else {}
    )
    return tuple(sorted(params.items()))


GOODPUT_FLOOR = 0.98  # a tuned peer keeps this share of its grid's best goodput


def _tuned_order(grid: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How a tuned peer is chosen: among the points within GOODPUT_FLOOR of the grid's best
    goodput (a setting that herds can show a low TTFT while its engines fall behind), the lowest
    TTFT p99 at the tuning load, then the highest hit rate; the others after them."""
    floor = GOODPUT_FLOOR * max(g["goodput_rps"] for g in grid)
    return sorted(grid, key=lambda g: (g["goodput_rps"] < floor, g["ttft_p99_s"], -g["hit_rate"]))


def _tune(
    pool: ProcessPoolExecutor,
    sources: Sequence[tuple[str, int | None]],
    nodes: int,
    peers: Sequence[str],
    caps: dict[str, float],
    defaults: list[dict[str, Any]],
) -> tuple[dict[str, dict[str, dict[str, Any]]], list[dict[str, Any]]]:
    """A grid over each peer's parameters (TUNING_GRID) on each workload at TUNE_LOAD; the
    defaults' runs come from the main results. Returns trace → peer → best and the grid, and
    the grid's runs."""
    work = [
        (s, lim, nodes, RouterSettings(policy=p, policy_params=params), TUNE_LOAD, caps[s])
        for s, lim in sources
        for p in peers
        for params in grid_points(p)[1:]
    ]
    grid = list(tracked(pool.map(_one, work), len(work), "tuning the peers"))
    runs = grid + [r for r in defaults if r["policy"] in peers and r["load"] == TUNE_LOAD]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in runs:
        peer = out.setdefault(r["trace"], {}).setdefault(r["policy"], {"grid": []})
        peer["grid"].append(
            {
                "params": dict(_params(r)),
                "ttft_p99_s": r["ttft_p99_s"],
                "hit_rate": r["hit_rate"],
                "slo_attainment": r["slo_attainment"],
                "goodput_rps": r["goodput_rps"],
            }
        )
    for peers_at in out.values():
        for peer in peers_at.values():
            peer["grid"] = _tuned_order(peer["grid"])
            peer["best"] = peer["grid"][0]["params"]
    return out, grid


def _capacity(args: tuple[str, int | None, int]) -> tuple[str, float]:
    source, limit, nodes = args
    trace = open_trace(source, limit=limit)
    return source, capacity_rps(trace, replace(SimConfig(), nodes=nodes))


def bench_routing(
    sources: Sequence[tuple[str, int | None]],
    *,
    nodes: int,
    loads: list[float],
    out_dir: Path,
    command: str,
    policies: Sequence[str] = tuple(POLICIES),
    jobs: int = 2,
    tune: bool = True,
) -> dict[str, Any]:
    started = time.time()
    with ProcessPoolExecutor(jobs) as pool:
        caps = dict(pool.map(_capacity, [(s, lim, nodes) for s, lim in sources]))
        work = [
            (s, lim, nodes, p, load, caps[s])
            for s, lim in sources
            for load in loads
            for p in policies
        ]
        results = list(tracked(pool.map(_one, work), len(work), "simulations"))
        peers = [p for p in policies if p in TUNING_GRID] if tune else []
        tuning, grid = _tune(pool, sources, nodes, peers, caps, results) if peers else ({}, [])
        # each tuned peer at every load: runs already made (defaults, the grid) are reused
        done = {(r["trace"], r["policy"], _params(r), r["load"]): r for r in results + grid}
        more = []
        for s, lim in sources:
            name = open_trace(s, limit=lim).name
            for p, t in tuning.get(name, {}).items():
                for load in loads:
                    known = done.get((name, p, tuple(sorted(t["best"].items())), load))
                    if known is not None:
                        results.append({**known, "policy": p + TUNED})
                    else:
                        settings = RouterSettings(policy=p, policy_params=t["best"])
                        more.append((s, lim, nodes, settings, load, caps[s]))
        for r in tracked(pool.map(_one, more), len(more), "tuned peers"):
            results.append({**r, "policy": r["policy"] + TUNED})
    speed = _speed(sources, nodes, caps)
    bounds = _bounds(sources, loads, caps)
    report = {
        "command": command,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": round(time.time() - started),
        "nodes": nodes,
        "capacity_rps": {open_trace(s, limit=lim).name: caps[s] for s, lim in sources},
        "targets": targets(results) + conversation_targets(results, bounds) + speed_targets(speed),
        "tuning": tuning,
        "bounds": bounds,
        "sim_requests_per_min_alone": speed,
        "results": results,
    }
    _write(report, out_dir)
    return report


def _speed(
    sources: Sequence[tuple[str, int | None]], nodes: int, caps: dict[str, float]
) -> dict[str, dict[str, Any]]:
    """The simulator's speed on each workload on its own (the benchmark's runs share the cores
    two by two), three runs each: this machine is noisy, the median is what to expect and the
    best what it can do."""
    speed = {}
    for s, lim in sources:
        with status(f"measuring the simulator's speed on {Path(s).name}"):
            runs = [_one((s, lim, nodes, "kvgate", 0.8, caps[s])) for _ in range(SPEED_RUNS)]
        per_min = sorted(r["sim_requests_per_min"] for r in runs)
        speed[runs[0]["trace"]] = {
            "median": per_min[len(per_min) // 2],
            "best": per_min[-1],
            "runs": per_min,
        }
    return speed


def _bounds(
    sources: Sequence[tuple[str, int | None]], loads: Sequence[float], caps: dict[str, float]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Each workload's latency bounds at each load (policy-independent): trace → load →
    :func:`analytics.sim.metrics.latency_bounds`."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for s, lim in sources:
        trace = open_trace(s, limit=lim)
        with status(f"TTFT floors of {trace.name}"):
            out[trace.name] = {str(load): bounds_at(trace, load, caps[s]) for load in loads}
    return out


def reuse(
    sources: Sequence[tuple[str, int | None]],
    out_dir: Path,
    command: str,
    rerun: Sequence[str] = (),
    jobs: int = 2,
) -> dict[str, Any]:
    """``out_dir/routing.json`` brought up to date without running it all again: the policies
    in ``rerun`` replay every workload at every load of the saved runs (after a change to
    them; the other policies' runs and the peers' tuning are kept), then the bounds, targets,
    tables and plots are computed again. ``sources``: the workloads the saved runs replayed.
    A tuned peer cannot be rerun this way (its tuning would have to run again too)."""
    tuned = [p for p in rerun if p in TUNING_GRID]
    if tuned:
        raise ValueError(f"{', '.join(tuned)}: tuned peers are rerun by the whole benchmark")
    started = time.time()
    report: dict[str, Any] = json.loads((out_dir / "routing.json").read_text())
    caps: dict[str, float] = {}
    ran: list[tuple[str, int | None]] = []
    for s, lim in sources:
        name = open_trace(s, limit=lim).name
        if name in report["capacity_rps"]:
            caps[s] = report["capacity_rps"][name]
            ran.append((s, lim))
    results: list[dict[str, Any]] = report["results"]
    loads = sorted({r["load"] for r in results if r["load"] is not None})
    if rerun:
        work = [
            (s, lim, report["nodes"], p, load, caps[s])
            for s, lim in ran
            for load in loads
            for p in rerun
        ]
        with ProcessPoolExecutor(jobs) as pool:
            fresh = list(tracked(pool.map(_one, work), len(work), "simulations"))
        again = {(r["trace"], r["policy"], r["load"]): r for r in fresh}
        results = [again.pop((r["trace"], r["policy"], r["load"]), r) for r in results]
        results += list(again.values())
        if "kvgate" in rerun:
            report["sim_requests_per_min_alone"] = _speed(ran, report["nodes"], caps)
    report["results"] = results
    report["bounds"] = _bounds(ran, loads, caps)
    report["targets"] = (
        targets(results)
        + conversation_targets(results, report["bounds"])
        + speed_targets(report["sim_requests_per_min_alone"])
    )
    report["reused"] = {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "rerun": list(rerun),
        "wall_s": round(time.time() - started),
    }
    _write(report, out_dir)
    return report


def _write(report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "routing.json").write_text(json.dumps(report, indent=2) + "\n")
    plots = _plots(report, out_dir)
    (out_dir / "routing.md").write_text(_markdown(report, plots))


def _plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    traces = sorted({r["trace"] for r in report["results"]})
    for metric, label in (("ttft_p99_s", "TTFT p99 (s, log)"), ("hit_rate", "prefix hit rate")):
        fig, axes = plt.subplots(
            2, (len(traces) + 1) // 2, figsize=(5 * ((len(traces) + 1) // 2), 8)
        )
        for ax, trace in zip(axes.flat, traces, strict=False):
            rows = [r for r in report["results"] if r["trace"] == trace]
            for policy in sorted({r["policy"] for r in rows}):
                pts = sorted((r["load"], r[metric]) for r in rows if r["policy"] == policy)
                ax.plot(
                    [x for x, _ in pts],
                    [y for _, y in pts],
                    marker="o",
                    linewidth=2.5 if policy == "kvgate" else 1,
                    label=policy,
                )
            ax.set_title(trace, fontsize=9)
            ax.set_xlabel("offered load / capacity")
            ax.set_ylabel(label)
            if metric == "ttft_p99_s":
                ax.set_yscale("log")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        name = f"routing_{metric}.png"
        fig.savefig(out_dir / name, dpi=80)
        plt.close(fig)
        names.append(name)
    return names


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "–" if v is None else str(v)


def _tuning_markdown(tuning: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    if not tuning:
        return []
    lines = [
        "",
        "## Tuned peers",
        "",
        f"Each peer's parameters searched on each workload at {TUNE_LOAD:.0%} load over the grid "
        "of `router.policies.TUNING_GRID` (the defaults included), keeping the lowest TTFT p99 "
        f"(then the highest hit rate) among the points within {GOODPUT_FLOOR:.0%} of the grid's "
        f"best goodput; `<peer>{TUNED}` rows below run those parameters at every "
        "load. Tuned in sample: the peer at its best on this very traffic.",
        "",
        "| workload | peer | tuned parameters | TTFT p99 defaults → tuned | hit rate defaults → "
        "tuned | grid |",
        "|---|---|---|---|---|---:|",
    ]
    for trace, peers in sorted(tuning.items()):
        for peer, t in sorted(peers.items()):
            default = next(g for g in t["grid"] if g["params"] == dict(_params({"policy": peer})))
            best = t["grid"][0]
            params = ", ".join(f"{k} {v:g}" for k, v in best["params"].items())
            if best is default:
                params += " (the defaults)"
            lines.append(
                f"| {trace} | {peer} | {params} | {default['ttft_p99_s']:.3f} → "
                f"{best['ttft_p99_s']:.3f} | {default['hit_rate']:.3f} → {best['hit_rate']:.3f} | "
                f"{len(t['grid'])} |"
            )
    return lines


def _markdown(report: dict[str, Any], plots: list[str]) -> str:
    lines = [
        "# Routing benchmark (virtual-time simulation)",
        "",
        f"Command: `{report['command']}`",
        "",
        *(
            [
                f"Updated on {report['reused']['date']} by `{report['reused']['command']}`: "
                + (
                    f"{', '.join(report['reused']['rerun'])} ran again; the other policies' "
                    "runs (and the peers' tuning) are those of the command above, "
                    if report["reused"]["rerun"]
                    else "no run again; "
                )
                + "the bounds, targets and tables were computed again.",
                "",
            ]
            if report.get("reused")
            else []
        ),
        f"Machine: {report['machine']}; date {report['date']}; {report['wall_s']} s of wall "
        f"time. {report['nodes']} simulated engines (Llama-3.1-8B on H100 profile, "
        "docs/engine-model.md); the router sees heartbeats every 0.5 s and KV events 150 ms "
        "late, and counts its own dispatches. Load is relative to the capacity measured on the "
        "same workload (saturated throughput under least-requests). SLO: TTFT ≤ 2 s and TPOT ≤ "
        "0.1 s. `hit_bound` is the infinite-cache bound; `hit_bound_causal` the same without "
        "time travel (a block counts only once an idle engine could have computed it: compressed "
        "chat sessions send the next turn before the previous answer can exist); "
        "`hit_bound_pooled_lru` what one LRU cache with the whole cluster's KV memory would "
        "reach.",
        "",
        "The baselines are copies of peer routers' policies; docs/baselines.md says what each "
        "source does, what the copy does, every difference, and how the copies' numbers moved "
        "when they were re-read against their sources.",
        "",
        "## Targets",
        "",
        "`within reach`: whether any router could meet a latency or SLO target on these "
        "engines. Each request's TTFT floor is its prefill on an idle engine holding every "
        "block of its prompt that could exist by then (an infinite cache, no queue: "
        "`analytics.sim.traces.ttft_floors`); no policy's TTFT percentile is below the floors' "
        "(checked request by request against simulated runs in the tests), and no policy "
        "meets the TTFT SLO for more requests than the floors do.",
        "",
        "| target | workload | kvgate | reference | ratio | met | within reach |",
        "|---|---|---:|---|---:|---|---|",
    ]
    for t in report["targets"]:
        reach = ""
        if "feasible" in t:
            reach = f"{'yes' if t['feasible'] else '**no**'} ({t['bound']})"
        lines.append(
            f"| {t['target']} | {t['trace']} | {_fmt(t['kvgate'])} | {t['reference']} | "
            f"{t['ratio']:.3f} | {'yes' if t['met'] else '**no**'} | {reach} |"
        )
    lines += _tuning_markdown(report.get("tuning") or {})
    lines += ["", *[f"![{p}]({p})" for p in plots], ""]
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for r in report["results"]:
        groups.setdefault((r["trace"], r["load"]), []).append(r)
    bounds = report.get("bounds") or {}
    for (trace, load), rows in groups.items():
        cap = rows[0]["capacity_rps"]
        b = bounds.get(trace, {}).get(str(load))
        floor = (
            f"; TTFT floor p50 {_fmt(b['ttft_floor_p50_s'])} s, p99 {_fmt(b['ttft_floor_p99_s'])} "
            f"s, SLO bound {_fmt(b['slo_bound'])}"
            if b
            else ""
        )
        lines += [
            f"## {trace}, load {load} (capacity {cap:.1f} req/s, {rows[0]['requests']} "
            f"requests{floor})",
            "",
            "| policy | " + " | ".join(KEYS) + " |",
            "|---|" + "---:|" * len(KEYS),
        ]
        for r in sorted(rows, key=lambda x: x["ttft_p99_s"] or 0):
            lines.append(f"| {r['policy']} | " + " | ".join(_fmt(r.get(k)) for k in KEYS) + " |")
        lines.append("")
    alone = report["sim_requests_per_min_alone"]
    lines += [
        "## Simulator speed",
        "",
        "Simulated requests per minute of wall time, one run at a time (kvgate, 80 % load; "
        f"target {SPEED_TARGET:,}), {SPEED_RUNS} runs per workload:",
        "",
        "| workload | median | best | runs |",
        "|---|---:|---:|---|",
        *[
            f"| {t} | {v['median']:,} | {v['best']:,} | {', '.join(f'{x:,}' for x in v['runs'])} |"
            for t, v in alone.items()
        ],
        "",
    ]
    return "\n".join(lines)
