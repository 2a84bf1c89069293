"""``kvgate tune``: search the ``kvgate`` policy's weights on the simulator with Optuna.

Every trial is a replay of the same traffic (a trace, a workload, or a window recorded in
ClickHouse) through the simulator, which runs the live router's policy code: TPE proposes the
weights (seeded: the same budget and seed give the same trials), a trial that is worse than the
median on the first half of the traffic is pruned before the second half runs, and the current
settings are the first trial, so the best is never worse than today's on this traffic.

The result is reported next to the replay of the current settings (and the recording, for a
ClickHouse window: the simulator's error on this traffic is the confidence of the prediction),
with each weight's importance in the search (PED-ANOVA) and its local sensitivity (the objective
with that one weight halved and doubled around the best point).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from analytics.sim.traces import Trace
from analytics.tuning import Candidate, replay_side

__all__ = [
    "OBJECTIVES",
    "SPACE",
    "Param",
    "TuneResult",
    "objective_value",
    "offered_rps",
    "render_html",
    "render_text",
    "summary",
    "tune",
    "with_weights",
]


@dataclass(frozen=True, slots=True)
class Param:
    low: float
    high: float
    log: bool = False
    integer: bool = False


# the kvgate policy's weights that shape its decisions (router/decision/weights.py CostWeights); the
# engine-model terms (step times, prefill rate) are measurements, not weights: not searched
SPACE: dict[str, Param] = {
    "prefill_weight": Param(0.1, 20.0, log=True),
    "interference": Param(0.0, 5.0),
    "congestion": Param(0.0, 5.0),
    "decode_horizon_tokens": Param(0, 512, integer=True),
    "kv_soft_limit": Param(0.5, 0.99),
    "kv_pressure_s": Param(0.1, 100.0, log=True),
    "session_affinity_s": Param(0.0, 2.0),
    "affinity_load_bound": Param(1.0, 4.0),
}

# name -> (metric, +1 to maximize / -1 to minimize); goodput: requests within the SLO per
# second of the traffic's arrival window (the offered rate × the SLO attainment of offered:
# unlike completions over the run's span, it does not reward a quicker drain of the tail)
OBJECTIVES: dict[str, tuple[str, int]] = {
    "goodput": ("slo_attainment", 1),
    "slo": ("slo_attainment", 1),
    "p99": ("ttft_p99_s", -1),
}


def objective_value(metrics: dict[str, Any], objective: str, offered_rps: float = 1.0) -> float:
    """The number to maximize: the metric, negated for a latency, × ``offered_rps`` for
    goodput; a run that served nothing is the worst possible."""
    key, sign = OBJECTIVES[objective]
    value = metrics.get(key)
    if value is None or not math.isfinite(float(value)):
        return -math.inf
    scale = offered_rps if objective == "goodput" else 1.0
    return sign * float(value) * scale


def offered_rps(trace: Trace) -> float:
    return len(trace.requests) / trace.span_s if trace.span_s > 0 else float(len(trace.requests))


def with_weights(c: Candidate, weights: dict[str, float]) -> Candidate:
    """``c`` with these cost weights (the version bumped: a new set of weights)."""
    cost = c.router.cost.model_copy(update={**weights, "version": c.router.cost.version + 1})
    router = c.router.model_copy(update={"policy": "kvgate", "cost": cost})
    return replace(c, router=router)


@dataclass(slots=True)
class TuneResult:
    best: dict[str, float]  # the best weights
    best_value: float
    current_value: float
    trials: list[dict[str, Any]]
    importance: dict[str, float]
    sensitivity: dict[str, dict[str, float]]
    pruned: int


def _suggest(trial: Any, space: dict[str, Param]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, p in space.items():
        if p.integer:
            out[name] = trial.suggest_int(name, int(p.low), int(p.high))
        else:
            out[name] = trial.suggest_float(name, p.low, p.high, log=p.log)
    return out


def tune(
    trace: Trace,
    current: Candidate,
    nodes: dict[str, int],
    *,
    budget: int = 200,
    objective: str = "goodput",
    seed: int = 0,
    ttft_slo_s: float = 2.0,
    tpot_slo_s: float = 0.1,
    space: dict[str, Param] | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> TuneResult:
    """``budget`` trials of the weights on ``trace`` replayed on ``nodes``; see the module."""
    import optuna

    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    if budget < 1:
        raise ValueError("the budget is at least one trial")
    space = space or SPACE
    half = trace.head(max(1, len(trace.requests) // 2))

    def run(tr: Trace, weights: dict[str, float]) -> float:
        c = with_weights(current, weights)
        side = replay_side("trial", tr, c, nodes, ttft_slo_s, tpot_slo_s)
        return objective_value(side.metrics, objective, offered_rps(tr))

    def trial_fn(trial: Any) -> float:
        weights = _suggest(trial, space)
        trial.report(run(half, weights), 0)
        if trial.should_prune():
            raise optuna.TrialPruned
        value = run(trace, weights)
        if progress is not None:
            progress(trial.number, value)
        return value

    logging.getLogger("optuna").setLevel(logging.WARNING)
    study = optuna.create_study(
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=10),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=10, n_warmup_steps=0),
    )
    now = current.router.cost.model_dump()
    start = {k: now[k] for k in space}
    study.enqueue_trial(start)  # today's settings: trial 0, never pruned (nothing to compare)
    study.optimize(trial_fn, n_trials=budget)
    best = dict(study.best_trial.params)
    best_value = float(study.best_value)
    current_value = float(study.trials[0].value) if study.trials[0].value is not None else -math.inf
    try:
        with warnings.catch_warnings():
            # too few or too alike trials: PED-ANOVA warns that every weight would tie
            warnings.simplefilter("error", UserWarning)
            evaluator = optuna.importance.PedAnovaImportanceEvaluator()
            found = optuna.importance.get_param_importances(study, evaluator=evaluator)
        importance = {k: round(float(v), 4) for k, v in found.items()}
    except (RuntimeError, ValueError, UserWarning):  # nothing to tell the weights apart
        importance = {}
    sensitivity: dict[str, dict[str, float]] = {}
    probe_best: tuple[float, dict[str, float]] | None = None
    for name, p in space.items():
        row: dict[str, float] = {}
        for label, factor in (("half", 0.5), ("double", 2.0)):
            value = min(p.high, max(p.low, best[name] * factor))
            if p.integer:
                value = round(value)
            if value == best[name]:
                continue
            probe = {**best, name: value}
            got = run(trace, probe)
            row[label] = round(got - best_value, 6)
            if got > best_value and (probe_best is None or got > probe_best[0]):
                probe_best = (got, probe)
        sensitivity[name] = row
    if probe_best is not None:  # a one-weight step from the best was better still: take it
        best_value, best = probe_best
    trials = [
        {"number": t.number, "value": t.value, "params": t.params, "state": t.state.name}
        for t in study.trials
    ]
    return TuneResult(
        best=best,
        best_value=best_value,
        current_value=current_value,
        trials=trials,
        importance=importance,
        sensitivity=sensitivity,
        pruned=sum(1 for t in study.trials if t.state == optuna.trial.TrialState.PRUNED),
    )


def summary(result: TuneResult, objective: str, budget: int) -> dict[str, Any]:
    """The search's figures for the report (JSON-ready)."""
    gain = result.best_value - result.current_value
    return {
        "objective": objective,
        "metric": OBJECTIVES[objective][0],
        "budget": budget,
        "trials": len(result.trials),
        "pruned": result.pruned,
        "current_value": result.current_value,
        "best_value": result.best_value,
        "gain": gain,
        "best_weights": result.best,
        "importance": result.importance,
        "sensitivity": result.sensitivity,
        "history": [
            {"number": t["number"], "value": t["value"], "state": t["state"]} for t in result.trials
        ],
    }


def _rows(t: dict[str, Any]) -> list[list[str]]:
    rows = [["weight", "best", "importance", "objective at ½×", "objective at 2×"]]
    for name, value in t["best_weights"].items():
        sens = t["sensitivity"].get(name, {})
        rows.append(
            [
                name,
                f"{value:.4g}",
                f"{t['importance'].get(name, 0.0):.2f}",
                f"{sens['half']:+.4g}" if "half" in sens else "–",
                f"{sens['double']:+.4g}" if "double" in sens else "–",
            ]
        )
    return rows


def _headline(t: dict[str, Any]) -> str:
    return (
        f"{t['trials']} trials ({t['pruned']} pruned) on {t['objective']} ({t['metric']}"
        f"{', negated' if OBJECTIVES[t['objective']][1] < 0 else ''}): current "
        f"{t['current_value']:.4g}, best {t['best_value']:.4g}"
    )


def render_text(t: dict[str, Any]) -> str:
    rows = _rows(t)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [_headline(t), ""]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def render_html(t: dict[str, Any]) -> str:
    """The search's section of the HTML report (trusted HTML, cells escaped)."""
    import html

    from analytics.htmlpage import table

    return (
        f"<h2>Search</h2><p>{html.escape(_headline(t))}. Importance: PED-ANOVA over the "
        "trials; the last two columns: the objective with that weight alone halved or doubled "
        f"around the best point, minus the best.</p>{table(_rows(t))}"
    )
