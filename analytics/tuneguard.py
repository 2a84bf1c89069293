"""What ``kvgate tune`` may recommend: never settings worse than the current ones.

A trial's objective can rise while what the operator lives by falls — a goodput gain bought
with a TTFT p99 seven times worse, or a load spread four times worse. So every trial keeps the
figures that guard a rollout (:data:`GUARDED`), the best is the highest-scoring trial that is
not worse than the current settings on any of them beyond noise (:func:`worse`), the better-
scoring trials that were passed over are reported with why (:func:`tradeoffs`), and the winner
is replayed against the current settings once more on traffic the search never saw (the last
part of it, :func:`split`) before ``--out`` may write it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from analytics.sim.traces import Trace

__all__ = ["GUARDED", "HELD_OUT", "guarded", "split", "tradeoffs", "worse"]

HELD_OUT = 1 / 3  # the share of the traffic (its end) kept for the validation
# figure -> (how to compare, tolerance): what a candidate may lose against the current settings
# before it counts as worse (noise between two replays of the same traffic)
GUARDED: dict[str, tuple[str, float]] = {
    "slo_attainment": ("higher", 0.002),  # absolute
    "goodput_rps": ("higher", 0.01),  # relative
    "ttft_p99_s": ("lower", 0.10),  # relative
    "tpot_p99_s": ("lower", 0.10),  # relative
    "max_over_mean_load": ("lower", 0.25),  # relative: the busiest node against the mean
}
_LABEL = {
    "slo_attainment": "SLO attainment",
    "goodput_rps": "goodput",
    "ttft_p99_s": "TTFT p99",
    "tpot_p99_s": "TPOT p99",
    "max_over_mean_load": "busiest node / mean load",
}


def guarded(metrics: Mapping[str, Any], offered_rps: float) -> dict[str, float | None]:
    """The guarded figures of a replay's metrics (goodput: the offered rate × the attainment,
    requests within the SLO per second of the traffic's arrival window)."""
    attainment = metrics.get("slo_attainment")
    out: dict[str, float | None] = {k: metrics.get(k) for k in GUARDED if k != "goodput_rps"}
    out["goodput_rps"] = None if attainment is None else float(attainment) * offered_rps
    out["ttft_p50_s"] = metrics.get("ttft_p50_s")
    return out


def _fmt(key: str, v: float) -> str:
    if key == "slo_attainment":
        return f"{v:.1%}"
    if key == "goodput_rps":
        return f"{v:.2f} req/s"
    if key == "max_over_mean_load":
        return f"{v:.2f}"
    return f"{v:.3f} s"


def worse(candidate: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Where ``candidate`` is worse than ``current`` beyond :data:`GUARDED`'s tolerances, in
    words ("TTFT p99 33.800 s against 4.700 s (7.2×)"); empty when it is not."""
    out: list[str] = []
    for key, (better, tol) in GUARDED.items():
        new, old = candidate.get(key), current.get(key)
        if old is None or (isinstance(old, float) and not math.isfinite(old)):
            continue
        if new is None or (isinstance(new, float) and not math.isfinite(new)):
            out.append(f"{_LABEL[key]}: none (the current settings: {_fmt(key, float(old))})")
            continue
        new, old = float(new), float(old)
        if key == "slo_attainment":
            bad = new < old - tol
        elif better == "higher":
            bad = new < old * (1 - tol)
        else:
            bad = new > old * (1 + tol) and new - old > 1e-3
        if bad:
            ratio = f" ({new / old:.1f}×)" if better == "lower" and old > 0 else ""
            out.append(f"{_LABEL[key]} {_fmt(key, new)} against {_fmt(key, old)}{ratio}")
    return out


def split(trace: Trace, held_out: float = HELD_OUT) -> tuple[Trace, Trace | None]:
    """The traffic the search tunes on (its beginning) and the traffic it is validated on (its
    last ``held_out`` share, by arrival); None when there is too little to hold any back."""
    n = len(trace.requests)
    keep = n - int(n * held_out)
    if n < 60 or keep >= n:
        return trace, None
    return (
        Trace(trace.name, trace.block_size, trace.requests[:keep]),
        Trace(f"{trace.name} (held out)", trace.block_size, trace.requests[keep:]),
    )


def tradeoffs(
    trials: list[dict[str, Any]], current: Mapping[str, Any], top: int = 5
) -> list[dict[str, Any]]:
    """The ``top`` best-scoring complete trials with their guarded figures and, for each, where
    it is worse than the current settings (empty: an acceptable candidate)."""
    done = [t for t in trials if t.get("value") is not None and t.get("figures")]
    done.sort(key=lambda t: -float(t["value"]))
    return [
        {
            "number": t["number"],
            "value": t["value"],
            "figures": t["figures"],
            "worse": worse(t["figures"], current),
        }
        for t in done[:top]
    ]
