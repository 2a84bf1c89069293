"""Sessions at once, swept (``kvgate bench agentic``): kvgate, round-robin and the peers tuned at
the benchmark's concurrency, at concurrencies around it — one run each. Where the sessions
alive need more KV than the cluster has, the simulation is chaotic (one request placed
elsewhere moves a run's figures by points), so a comparison at one concurrency can be an
accident; this says which way the figures lean over several."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from analytics.progress import status
from analytics.sim.bench_report import fmt
from analytics.sim.bench_targets import TUNED
from analytics.sim.traces import Trace
from router.settings import RouterSettings

__all__ = ["SWEEP_SHARES", "sweep_concurrency", "sweep_markdown"]

SWEEP_SHARES = (0.6, 0.7, 0.8, 0.9, 1.0)  # sessions at once, as shares of the trace's sessions
FIGURES = ("hit_rate", "ttft_p99_s", "tok_s_per_gpu", "tok_s_per_user")

Run = Callable[[Trace, RouterSettings], dict[str, Any]]


def sweep_concurrency(
    sessions: int,
    schedule: Callable[[int], Trace],
    tuned: dict[str, Any],
    run: Run,
    known: dict[int, dict[str, dict[str, Any]]],
) -> dict[str, Any]:
    """Per number of sessions at once (:data:`SWEEP_SHARES` of ``sessions``; ``schedule``
    gives the trace), the figures of kvgate, round-robin and each peer at its ``tuned`` point
    (``known``: runs already made, by concurrency and router); and per router the medians."""
    routers = {
        "kvgate": RouterSettings(policy="kvgate"),
        "round_robin": RouterSettings(policy="round_robin"),
        **{p + TUNED: RouterSettings(policy=p, policy_params=t["best"]) for p, t in tuned.items()},
    }
    out: dict[str, dict[str, Any]] = {}
    for share in SWEEP_SHARES:
        slots = max(1, round(share * sessions))
        have = known.get(slots, {})
        trace = schedule(slots)
        row: dict[str, Any] = {}
        for name, settings in routers.items():
            got = have.get(name)
            if got is None:
                with status(f"agentic: {name}, {slots} at once"):
                    got = run(trace, settings)
            row[name] = {k: got[k] for k in FIGURES}
        out[str(slots)] = row
    medians = {
        name: {k: round(statistics.median(r[name][k] for r in out.values()), 3) for k in FIGURES}
        for name in routers
    }
    return {"runs": out, "medians": medians}


def sweep_markdown(sweep: dict[str, Any] | None) -> str:
    """The sweep as a table: per concurrency, hit rate / TTFT p99 / tokens per GPU of kvgate,
    the tuned peer with the shortest median tail, and round-robin."""
    if not sweep:
        return ""
    med = sweep["medians"]
    peers = [p for p in med if p.endswith(TUNED)]
    tail = min(peers, key=lambda p: med[p]["ttft_p99_s"]) if peers else None
    cols = ["kvgate", *([tail] if tail else []), "round_robin"]

    def cell(m: dict[str, Any]) -> str:
        return " / ".join(fmt(m[k]) for k in ("hit_rate", "ttft_p99_s", "tok_s_per_gpu"))

    rows = "\n".join(
        f"| {slots} | " + " | ".join(cell(row[c]) for c in cols) + " |"
        for slots, row in sweep["runs"].items()
    )
    rows += "\n| median | " + " | ".join(cell(med[c]) for c in cols) + " |"
    return f"""Sessions at once swept (one run each, the peers at the points tuned above; hit rate /
TTFT p99 s / tokens per GPU; the tuned peer with the shortest median tail):

| sessions at once | {" | ".join(cols)} |
|---:|{"---|" * len(cols)}
{rows}
"""
