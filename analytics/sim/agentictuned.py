"""The peers tuned on the agentic workload (``kvgate bench agentic``): each peer's parameters
searched over its grid (router/decision/policies: TUNING_GRID) on the open loop's first
repetition and chosen by the rule of ``kvgate bench routing`` (docs/baselines.md, "Tuned
peers"): among the points within GOODPUT_FLOOR of the grid's best tokens per GPU, the lowest
TTFT p99, then the highest hit rate. The chosen point then runs every repetition, as
``<peer>+tuned``, and the best peer is the best of defaults and tuned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from analytics.progress import status
from analytics.sim.bench_targets import GOODPUT_FLOOR, TUNED
from analytics.sim.traces import Trace
from router.decision.policies import TUNING_GRID, grid_points
from router.settings import RouterSettings

__all__ = ["TunedRun", "tune_peers"]

TunedRun = Callable[[Trace, RouterSettings, int], dict[str, Any]]


def _order(grid: list[dict[str, Any]]) -> list[dict[str, Any]]:
    floor = GOODPUT_FLOOR * max(g["tok_s_per_gpu"] for g in grid)
    return sorted(grid, key=lambda g: (g["tok_s_per_gpu"] < floor, g["ttft_p99_s"], -g["hit_rate"]))


def tune_peers(
    peers: tuple[str, ...],
    traces: list[Trace],
    defaults: dict[str, list[dict[str, Any]]],
    run: TunedRun,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Each of ``peers`` with a grid tuned on ``traces[0]`` (its defaults' runs: the first of
    ``defaults[peer]``), then the chosen point on every trace (``run(trace, settings, rep)``;
    the defaults' runs reused where the defaults win). Returns ``<peer>+tuned`` → its runs,
    and per peer the chosen parameters and the grid."""
    runs: dict[str, list[dict[str, Any]]] = {}
    chosen: dict[str, Any] = {}
    for peer in peers:
        if peer not in TUNING_GRID:
            continue
        points = grid_points(peer)
        grid = [{"params": points[0], **defaults[peer][0]}]
        for params in points[1:]:
            with status(f"agentic: tuning {peer} {params}"):
                got = run(traces[0], RouterSettings(policy=peer, policy_params=params), 0)
            grid.append({"params": params, **got})
        grid = _order(grid)
        best = grid[0]["params"]
        if best == points[0]:
            out = list(defaults[peer])
        else:
            out = [grid[0]]
            for rep, trace in enumerate(traces[1:], start=1):
                with status(f"agentic: {peer}{TUNED} #{rep + 1}"):
                    out.append(run(trace, RouterSettings(policy=peer, policy_params=best), rep))
        runs[peer + TUNED] = [{k: v for k, v in r.items() if k != "params"} for r in out]
        chosen[peer] = {
            "best": best,
            "grid": [
                {
                    "params": g["params"],
                    **{k: g[k] for k in ("tok_s_per_gpu", "hit_rate", "ttft_p99_s")},
                }
                for g in grid
            ],
        }
    return runs, chosen
