"""The cold start of ``kvgate bench routing``: the first minute after the routers and the engines
start, on engines whose prefill is 12.5× slower than the routers' configured rate.

Everything is cold: empty KV caches, routers that have learned nothing. The first seconds decide
where each prompt's first copy is computed and whether the requests that follow it queue behind
it or compute it again; a router that prices a miss at its configured 25,000 prompt tokens per
second when the engines do 2,000 spreads copies over the cluster before its own first tokens
have taught it better. Every policy runs each workload at each of :data:`COLD_LOADS` of the slow
engines' capacity; TTFT and the hit rate count the requests that arrive in the first
:data:`COLD_WINDOW_S` seconds (the next :data:`COLD_TAIL_S` seconds of arrivals load the engines
but are not measured). kvgate runs twice: at its defaults (its agents measured the engines'
rate, agents/probe.py) and with that probe off (``kvgate, no probe``: the configured rate until
its first tokens teach it).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from agents.profile import EngineProfile
from analytics.progress import tracked
from analytics.sim.replay import at_load, capacity_rps, open_trace, replay_trace
from analytics.sim.simconfig import SimConfig
from analytics.sim.traces import Trace

__all__ = ["COLD_KEYS", "cold_markdown", "cold_start"]

COLD_PREFILL_TOKENS_PER_S = 2_000.0
COLD_WINDOW_S = 60.0
COLD_TAIL_S = 30.0
COLD_LOADS = (0.5, 0.8)
NO_PROBE = "kvgate, no probe"
COLD_KEYS = ("ttft_p50_s", "ttft_p99_s", "hit_rate", "refused", "requests")


def _cfg(nodes: int, probe: bool = True) -> SimConfig:
    profile = EngineProfile(prefill_tokens_per_s=COLD_PREFILL_TOKENS_PER_S)
    return replace(SimConfig(), nodes=nodes, profile=profile, prefill_probe=probe)


def _window(trace: Trace, load: float, capacity: float) -> Trace:
    """``trace`` at ``load`` × ``capacity``, cut after the window and its tail."""
    scaled = at_load(trace, load, capacity)
    if not scaled.requests:
        return scaled
    end = scaled.requests[0].arrival_s + COLD_WINDOW_S + COLD_TAIL_S
    return Trace(
        scaled.name, scaled.block_size, tuple(r for r in scaled.requests if r.arrival_s < end)
    )


def _capacity(args: tuple[str, int | None, int]) -> float:
    source, limit, nodes = args
    return capacity_rps(open_trace(source, limit=limit), _cfg(nodes))


def _one(args: tuple[str, int | None, int, str, bool, float, float]) -> dict[str, Any]:
    source, limit, nodes, policy, probe, load, cap = args
    trace = _window(open_trace(source, limit=limit), load, cap)
    out = replay_trace(
        trace,
        nodes=nodes,
        policy=policy,
        load=None,
        cfg=_cfg(nodes, probe),
        measure_until_s=COLD_WINDOW_S,
    )
    out.update({"load": load, "capacity_rps": cap})
    if not probe:
        out["policy"] = NO_PROBE
    return out


def cold_start(
    sources: Sequence[tuple[str, int | None]],
    nodes: int,
    policies: Sequence[str],
    pool: ProcessPoolExecutor,
) -> dict[str, Any]:
    """Every policy's first minute on each workload (and kvgate's without the probe)."""
    caps = list(pool.map(_capacity, [(s, lim, nodes) for s, lim in sources]))
    runs = [(p, True) for p in policies] + ([("kvgate", False)] if "kvgate" in policies else [])
    work = [
        (s, lim, nodes, p, probe, load, cap)
        for (s, lim), cap in zip(sources, caps, strict=True)
        for load in COLD_LOADS
        for p, probe in runs
    ]
    results = list(tracked(pool.map(_one, work), len(work), "cold starts"))
    return {
        "prefill_tokens_per_s": COLD_PREFILL_TOKENS_PER_S,
        "window_s": COLD_WINDOW_S,
        "tail_s": COLD_TAIL_S,
        "loads": list(COLD_LOADS),
        "results": results,
    }


def cold_markdown(cold: dict[str, Any] | None, fmt: Any) -> list[str]:
    """The cold start's section of routing.md (none when the report has no cold start)."""
    if not cold:
        return []
    lines = [
        "## Cold start",
        "",
        f"The first {cold['window_s']:.0f} s after the routers and the engines start: empty "
        f"caches, routers that learned nothing, engines that prefill "
        f"{cold['prefill_tokens_per_s']:,.0f} prompt tokens/s (the routers' configured rate is "
        f"25,000), at {' and '.join(str(x) for x in cold['loads'])} of those engines' "
        "capacity. Measured: the requests that arrive in the window (the next "
        f"{cold['tail_s']:.0f} s of arrivals load the engines). "
        f"`{NO_PROBE}`: kvgate without its agents' measure of the engines' rate "
        "(`agent.prefill_probe` off), pricing a miss at the configured rate until its own first "
        "tokens teach it.",
        "",
    ]
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in cold["results"]:
        groups.setdefault((r["trace"], r["load"]), []).append(r)
    for (trace, load), rows in groups.items():
        lines += [
            f"### {trace}, load {load} (capacity {rows[0]['capacity_rps']:.1f} req/s)",
            "",
            "| policy | " + " | ".join(COLD_KEYS) + " |",
            "|---|" + "---:|" * len(COLD_KEYS),
        ]
        for r in sorted(rows, key=lambda x: x.get("ttft_p99_s") or 0):
            lines.append(
                f"| {r['policy']} | " + " | ".join(fmt(r.get(k)) for k in COLD_KEYS) + " |"
            )
        lines.append("")
    return lines
