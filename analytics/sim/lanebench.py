"""``long_tail`` of ``kvgate bench fleet``: head-of-line isolation (router/decision/lanes.py) —
short requests' TTFT, long requests' TPOT and throughput on the ``long_tail`` workload, without
the lane rules, with them, and with a lane of nodes."""

from __future__ import annotations

from typing import Any

from analytics.progress import status
from analytics.sim.bench_report import fmt
from analytics.sim.cluster import simulate
from analytics.sim.replay import capacity_rps, open_trace
from analytics.sim.simconfig import Done, SimConfig, with_router
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["long_tail_isolation", "long_tail_section"]


LONG_TAIL_LOADS = (0.8, 0.45)


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None


def long_tail_isolation(*, nodes: int = 16, requests: int = 6000) -> dict[str, Any]:
    """Head-of-line isolation (router/decision/lanes.py) on ``long_tail``: today's kvgate, the lane
    rules (defaults: KV share and the router's queue) and the rules with a lane of nodes, per load.
    Short and long as the default thresholds split them (8k-token prompt, 1k-token answer)."""
    trace0 = open_trace("long_tail", limit=requests)
    cap = capacity_rps(trace0, SimConfig(nodes=nodes))
    rate = len(trace0.requests) / max(1e-9, trace0.span_s)
    settings = RouterSettings(policy="kvgate")
    lanes = settings.lanes
    runs = (
        ("kvgate", None),
        ("lanes", lanes),
        ("lanes_with_node_lane", lanes.model_copy(update={"lane": True})),
    )
    out: dict[str, Any] = {"capacity_rps": round(cap, 3), "nodes": nodes, "requests": requests}
    for load in LONG_TAIL_LOADS:
        trace = trace0.scaled(rate / (load * cap))
        rows: dict[str, Any] = {}
        for label, rules in runs:
            cfg = with_router(SimConfig(nodes=nodes, lanes=rules), settings)
            with status(f"fleet: long_tail/{load}/{label}"):
                done = simulate(trace, make_policy(settings), cfg)

            def short(d: Done) -> bool:
                r = d.request
                return r.prompt_tokens < lanes.long_prompt_tokens and (
                    r.output_tokens < lanes.long_output_tokens
                )

            shorts = [d for d in done if short(d)]
            longs = [d for d in done if not short(d)]
            span = max(d.finish_s for d in done) - min(d.request.arrival_s for d in done)
            rows[label] = {
                "completed": len(done),
                "short_requests": len(shorts),
                "long_requests": len(longs),
                "short_ttft_p50_s": _pct(
                    [d.first_token_s - d.request.arrival_s for d in shorts], 0.5
                ),
                "short_ttft_p99_s": _pct(
                    [d.first_token_s - d.request.arrival_s for d in shorts], 0.99
                ),
                "long_ttft_p99_s": _pct(
                    [d.first_token_s - d.request.arrival_s for d in longs], 0.99
                ),
                "long_tpot_p99_s": _pct(
                    [
                        (d.finish_s - d.first_token_s) / (d.request.output_tokens - 1)
                        for d in longs
                        if d.request.output_tokens > 1
                    ],
                    0.99,
                ),
                "output_tokens_per_s": round(sum(d.request.output_tokens for d in done) / span, 1),
            }
        base = rows["kvgate"]
        for label in ("lanes", "lanes_with_node_lane"):
            r = rows[label]
            r["short_ttft_p99_ratio"] = round(r["short_ttft_p99_s"] / base["short_ttft_p99_s"], 3)
            r["throughput_ratio"] = round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
            r["long_tpot_p99_ratio"] = round(r["long_tpot_p99_s"] / base["long_tpot_p99_s"], 3)
        out[f"load_{load}"] = rows
    return out


def long_tail_section(r: dict[str, Any]) -> list[str]:
    """Long requests against short ones (the lane rules)."""
    hol = r.get("long_tail")
    if not hol:
        return []
    lines = [
        "",
        "## Long requests must not block short ones (`long_tail`)",
        "",
        f"{hol['nodes']} nodes, {hol['requests']} requests of the `long_tail` workload "
        "(no sharing; prompts lognormal around 800 tokens up to 32k, answers around 150 "
        "up to 2k). Short: prompt under 8,192 tokens and answer under 1,024; long: the "
        "rest. `kvgate`: today's policy without the lane rules; `lanes`: the defaults "
        "(long requests within half a node's KV, the router's queue with short requests "
        "first); `lanes_with_node_lane`: plus a lane of nodes for long prompts. Loads are "
        f"fractions of `capacity_rps` ({hol['capacity_rps']} req/s, a burst's completion "
        "rate): on this heavy-tailed trace that over-states what the fleet sustains, so "
        "0.8 is overload and 0.45 is about 80 % of the sustained rate. Ratios are against "
        "`kvgate` at the same load; throughput is output tokens per second, first arrival "
        "to last finish.",
        "",
        "| load | run | completed | short TTFT p50 | short TTFT p99 | long TTFT p99 | "
        "long TPOT p99 | output tok/s | short p99 ratio | throughput ratio | "
        "long TPOT p99 ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, rows in hol.items():
        if not key.startswith("load_"):
            continue
        for label, v in rows.items():
            lines.append(
                f"| {key[5:]} | {label} | {v['completed']} | {fmt(v['short_ttft_p50_s'])} | "
                f"{fmt(v['short_ttft_p99_s'])} | {fmt(v['long_ttft_p99_s'])} | "
                f"{fmt(v['long_tpot_p99_s'])} | {fmt(v['output_tokens_per_s'])} | "
                f"{fmt(v.get('short_ttft_p99_ratio'))} | "
                f"{fmt(v.get('throughput_ratio'))} | "
                f"{fmt(v.get('long_tpot_p99_ratio'))} |"
            )
    return lines
