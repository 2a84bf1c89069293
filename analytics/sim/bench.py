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
from analytics.sim.bench_report import SPEED_RUNS, write_report
from analytics.sim.bench_targets import (
    GOODPUT_FLOOR,
    TUNE_LOAD,
    TUNED,
    conversation_targets,
    run_params,
    speed_targets,
    targets,
)
from analytics.sim.coldstart import cold_start
from analytics.sim.onecache import one_cache, one_cache_targets
from analytics.sim.replay import bounds_at, capacity_rps, open_trace, replay_trace
from analytics.sim.simconfig import SimConfig
from router.decision.policies import POLICIES, TUNING_GRID, grid_points
from router.settings import RouterSettings

__all__ = ["bench_routing", "reuse"]


def _one(args: tuple[str, int | None, int, str | RouterSettings, float, float]) -> dict[str, Any]:
    source, limit, nodes, policy, load, cap = args
    trace = open_trace(source, limit=limit)
    return replay_trace(trace, nodes=nodes, policy=policy, load=load, capacity=cap)


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
                "params": dict(run_params(r)),
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
        done = {(r["trace"], r["policy"], run_params(r), r["load"]): r for r in results + grid}
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
        cold = cold_start(sources, nodes, policies, pool)
        bounds = _bounds(sources, loads, caps)
        single = one_cache(pool, sources, nodes, caps, bounds, results)
    speed = _speed(sources, nodes, caps)
    report = {
        "command": command,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": round(time.time() - started),
        "nodes": nodes,
        "capacity_rps": {open_trace(s, limit=lim).name: caps[s] for s, lim in sources},
        "targets": targets(results)
        + conversation_targets(results, bounds)
        + speed_targets(speed)
        + one_cache_targets(single),
        "tuning": tuning,
        "bounds": bounds,
        "sim_requests_per_min_alone": speed,
        "results": results,
        "cold_start": cold,
        "one_cache": single,
    }
    write_report(report, out_dir)
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
    # the cold start is short: every policy runs it again, whatever ran again above
    everyone = sorted({r["policy"] for r in results if not r["policy"].endswith(TUNED)})
    with ProcessPoolExecutor(jobs) as pool:
        report["cold_start"] = cold_start(ran, report["nodes"], everyone, pool)
        report["bounds"] = _bounds(ran, loads, caps)
        report["one_cache"] = one_cache(pool, ran, report["nodes"], caps, report["bounds"], results)
    report["targets"] = (
        targets(results)
        + conversation_targets(results, report["bounds"])
        + speed_targets(report["sim_requests_per_min_alone"])
        + one_cache_targets(report["one_cache"])
    )
    report["reused"] = {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "rerun": list(rerun),
        "wall_s": round(time.time() - started),
    }
    write_report(report, out_dir)
    return report
