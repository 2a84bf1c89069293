"""How ``kvgate bench routing`` writes its report: ``routing.json`` (every number),
``routing.md`` (the targets, the peers' tuning, a table per workload and load, the simulator's
speed) and the PNG plots (TTFT p99 and hit rate against load)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from analytics.sim.bench_targets import (
    GOODPUT_FLOOR,
    SPEED_TARGET,
    TUNE_LOAD,
    TUNED,
    run_params,
)
from analytics.sim.coldstart import cold_markdown
from analytics.sim.onecache import one_cache_markdown

__all__ = ["KEYS", "SPEED_RUNS", "fmt", "write_report"]

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
    "refused",
)
SPEED_RUNS = 3  # runs per workload of the simulator's speed alone


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    """Write ``routing.json``, the plots and ``routing.md`` of ``report`` into ``out_dir``."""
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


def fmt(v: Any) -> str:
    """A table cell: floats to three decimals, a missing value as a dash."""
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
        "of `router.decision.policies.TUNING_GRID` (the defaults included), keeping the lowest "
        "TTFT p99 "
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
            default = next(
                g for g in t["grid"] if g["params"] == dict(run_params({"policy": peer}))
            )
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


def _results_markdown(report: dict[str, Any]) -> list[str]:
    """A table per workload and load: every policy's row, lowest TTFT p99 first."""
    lines: list[str] = []
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for r in report["results"]:
        groups.setdefault((r["trace"], r["load"]), []).append(r)
    bounds = report.get("bounds") or {}
    for (trace, load), rows in groups.items():
        cap = rows[0]["capacity_rps"]
        b = bounds.get(trace, {}).get(str(load))
        floor = (
            f"; TTFT floor p50 {fmt(b['ttft_floor_p50_s'])} s, p99 {fmt(b['ttft_floor_p99_s'])} "
            f"s, SLO bound {fmt(b['slo_bound'])}"
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
            lines.append(f"| {r['policy']} | " + " | ".join(fmt(r.get(k)) for k in KEYS) + " |")
        lines.append("")
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
        "reach, also without time travel (a block enters it when it could have been "
        "computed, as for `hit_bound_causal`; until 2026-12-04 every block of a request "
        "entered at its arrival, so a turn found an answer not written yet and the bound "
        "could exceed the causal one).",
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
            f"| {t['target']} | {t['trace']} | {fmt(t['kvgate'])} | {t['reference']} | "
            f"{t['ratio']:.3f} | {'yes' if t['met'] else '**no**'} | {reach} |"
        )
    lines += _tuning_markdown(report.get("tuning") or {})
    lines += ["", *[f"![{p}]({p})" for p in plots], ""]
    lines += _results_markdown(report)
    lines += cold_markdown(report.get("cold_start"), fmt)
    lines += one_cache_markdown(report.get("one_cache"), fmt)
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
