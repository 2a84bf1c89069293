"""The ``one_cache`` section of ``kvgate bench routing``: kvgate on engines that give and take a
prefix's KV (router/decision/pull.py), on the conversation workloads at 80 and 100 % load, beside
the references a single cache would be held to — the hit rate of one LRU cache with the whole
cluster's KV (``pooled_lru_bound``), the TTFT floor, and the best baseline's median TTFT."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from analytics.progress import tracked
from analytics.sim.bench_targets import BASELINES, TUNED
from analytics.sim.replay import open_trace, replay_trace
from analytics.sim.simconfig import SimConfig
from router.settings import RouterSettings

__all__ = [
    "ONE_CACHE",
    "ONE_CACHE_LOADS",
    "PULL_PRIORITY",
    "one_cache",
    "one_cache_markdown",
    "one_cache_targets",
]

ONE_CACHE = ("conversation", "mooncake_fast25_synthetic_trace")
ONE_CACHE_LOADS = (0.8, 1.0)


PULL_PRIORITY = -1  # router.pull_priority: holders answer a pull ahead of their queue


def _pulling(args: tuple[str, int | None, int, float, float, bool]) -> dict[str, Any]:
    source, limit, nodes, load, cap, priority = args
    trace = open_trace(source, limit=limit)
    cfg = replace(SimConfig(), kv_pull=True)
    settings = RouterSettings(policy="kvgate", pull_priority=PULL_PRIORITY if priority else None)
    return {
        **replay_trace(trace, nodes=nodes, policy=settings, load=load, capacity=cap, cfg=cfg),
        "pull_priority": priority,
    }


def one_cache(
    pool: ProcessPoolExecutor,
    sources: Sequence[tuple[str, int | None]],
    nodes: int,
    caps: dict[str, float],
    bounds: dict[str, dict[str, dict[str, Any]]],
    results: list[dict[str, Any]],
) -> dict[str, dict[str, dict[str, Any]]]:
    """workload → load → kvgate's figures with pulls beside the references (``results``: the
    benchmark's runs, for the best baseline; ``bounds``: its TTFT floors)."""
    work = [
        (s, lim, nodes, load, caps[s], priority)
        for s, lim in sources
        if open_trace(s, limit=lim).name in ONE_CACHE
        for load in ONE_CACHE_LOADS
        for priority in (True, False)
    ]
    runs = list(tracked(pool.map(_pulling, work), len(work), "one cache (pulls)"))
    queued = {(r["trace"], r["load"]): r for r in runs if not r["pull_priority"]}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in (r for r in runs if r["pull_priority"]):
        trace, load = r["trace"], r["load"]
        base = [
            b
            for b in results
            if b["trace"] == trace
            and b["load"] == load
            and b["policy"].removesuffix(TUNED) in BASELINES
        ]
        best = min(base, key=lambda b: b["ttft_p50_s"], default=None)
        without = next(
            (b for b in results if (b["trace"], b["policy"], b["load"]) == (trace, "kvgate", load)),
            None,
        )
        floor = bounds.get(trace, {}).get(str(load), {})
        out.setdefault(trace, {})[str(load)] = {
            "reuse": round(r["hit_rate"], 4),
            "pooled_lru_bound": round(r["hit_bound_pooled_lru"], 4),
            "ttft_p99_s": round(r["ttft_p99_s"], 4),
            "ttft_floor_p99_s": round(floor.get("ttft_floor_p99_s", float("nan")), 4),
            "ttft_p50_s": round(r["ttft_p50_s"], 4),
            "best_baseline_p50_s": round(best["ttft_p50_s"], 4) if best else None,
            "best_baseline": best["policy"] if best else None,
            "pulls": r["reasons"].get("kv_pull", 0),
            "pull_priority": PULL_PRIORITY,
            # the same with holders that answer a pull in their queue (no pull_priority)
            "in_holders_queue": _brief(queued.get((trace, load))),
            "without_pulls": _brief(without),
        }
    return out


def _brief(r: dict[str, Any] | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "reuse": round(r["hit_rate"], 4),
        "ttft_p99_s": round(r["ttft_p99_s"], 4),
        "ttft_p50_s": round(r["ttft_p50_s"], 4),
        "pulls": r["reasons"].get("kv_pull", 0),
    }


def one_cache_targets(section: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The one-cache targets, a row each: reuse at least the pooled LRU bound, TTFT p99 within
    1.10 × its floor, and at 100 % load a median TTFT at most half the best baseline's."""
    rows: list[dict[str, Any]] = []
    for trace, loads in sorted(section.items()):
        for load, s in sorted(loads.items()):
            rows.append(
                {
                    "target": f"one cache at {float(load):.0%} load: reuse >= the pooled LRU bound",
                    "trace": trace,
                    "load": float(load),
                    "kvgate": s["reuse"],
                    "reference": f"pooled LRU {s['pooled_lru_bound']:.4f}",
                    "ratio": round(s["reuse"] / max(s["pooled_lru_bound"], 1e-9), 3),
                    "met": s["reuse"] >= s["pooled_lru_bound"],
                }
            )
            ratio = s["ttft_p99_s"] / max(s["ttft_floor_p99_s"], 1e-9)
            rows.append(
                {
                    "target": f"one cache at {float(load):.0%} load: TTFT p99 <= 1.10x its floor",
                    "trace": trace,
                    "load": float(load),
                    "kvgate": s["ttft_p99_s"],
                    "reference": f"floor {s['ttft_floor_p99_s']:.3f}",
                    "ratio": round(ratio, 3),
                    "met": ratio <= 1.10,
                }
            )
            if float(load) == 1.0 and s["best_baseline_p50_s"]:
                ratio = s["ttft_p50_s"] / s["best_baseline_p50_s"]
                rows.append(
                    {
                        "target": "one cache at 100% load: TTFT p50 <= 0.5x the best baseline",
                        "trace": trace,
                        "load": 1.0,
                        "kvgate": s["ttft_p50_s"],
                        "reference": f"{s['best_baseline']} {s['best_baseline_p50_s']:.3f}",
                        "ratio": round(ratio, 3),
                        "met": ratio <= 0.5,
                    }
                )
    return rows


def one_cache_markdown(
    section: dict[str, dict[str, dict[str, Any]]] | None, fmt: Callable[[Any], str]
) -> list[str]:
    """``routing.md``'s one-cache table."""
    if not section:
        return []
    lines = [
        "## One cache: pulling a prefix's KV from its holder",
        "",
        "kvgate on engines that give and take a prefix's KV (router/decision/pull.py): a "
        "request its cost sends away from a busy holder loads the holder's prefix instead of "
        "computing it again; holders answer a pull ahead of their queue "
        f"(`router.pull_priority` {PULL_PRIORITY}). `reuse`: prompt tokens served from cache, "
        "local or pulled; `in queue`: the same with holders that answer a pull in their queue "
        "(no `pull_priority`); `without`: the same policy on engines that cannot pull (the "
        "main tables).",
        "",
        "| workload | load | reuse | pooled LRU | TTFT p99 | floor p99 | TTFT p50 | "
        "best baseline p50 | pulls | in queue: reuse, p99, p50, pulls | without: reuse, p99, "
        "p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for trace, loads in sorted(section.items()):
        for load, s in sorted(loads.items()):
            w = s.get("without_pulls") or {}
            without = ", ".join(fmt(w.get(k)) for k in ("reuse", "ttft_p99_s", "ttft_p50_s"))
            q = s.get("in_holders_queue") or {}
            queue = ", ".join(fmt(q.get(k)) for k in ("reuse", "ttft_p99_s", "ttft_p50_s", "pulls"))
            lines.append(
                f"| {trace} | {load} | {fmt(s['reuse'])} | {fmt(s['pooled_lru_bound'])} | "
                f"{fmt(s['ttft_p99_s'])} | {fmt(s['ttft_floor_p99_s'])} | {fmt(s['ttft_p50_s'])} "
                f"| {s['best_baseline']} {fmt(s['best_baseline_p50_s'])} | {s['pulls']} | "
                f"{queue} | {without} |"
            )
    return [*lines, ""]
