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
from dataclasses import dataclass, field, replace
from typing import Any

from analytics.sim.traces import Trace
from analytics.tuneguard import guarded, split, tradeoffs, worse
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
    "verdict",
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

TAIL_WEIGHT = 0.01  # of the full score, per TTFT p99 as large as the TTFT target
# name -> (metric, +1 to maximize / -1 to minimize); goodput: requests within the SLO per
# second of the traffic's arrival window (the offered rate × the SLO attainment of offered:
# unlike completions over the run's span, it does not reward a quicker drain of the tail)
OBJECTIVES: dict[str, tuple[str, int]] = {
    "goodput": ("slo_attainment", 1),
    "slo": ("slo_attainment", 1),
    "p99": ("ttft_p99_s", -1),
}


def objective_value(
    metrics: dict[str, Any],
    objective: str,
    offered_rps: float = 1.0,
    ttft_slo_s: float | None = None,
) -> float:
    """The number to maximize: the metric, negated for a latency, × ``offered_rps`` for
    goodput; a run that served nothing is the worst possible. The tail counts in goodput and
    SLO attainment (given the TTFT target ``ttft_slo_s``): past the target, they are scaled by
    target / TTFT p99 — a p99 seven times the target keeps a seventh of the score — and every
    trial pays :data:`TAIL_WEIGHT` × p99 / target (of the full score), so that of two trials
    meeting the SLO alike the one with the shorter tail scores higher."""
    key, sign = OBJECTIVES[objective]
    value = metrics.get(key)
    if value is None or not math.isfinite(float(value)):
        return -math.inf
    scale = offered_rps if objective == "goodput" else 1.0
    if sign < 0 or ttft_slo_s is None:
        return sign * float(value) * scale
    p99 = metrics.get("ttft_p99_s")
    if p99 is None or not math.isfinite(float(p99)):
        return -math.inf
    tail = float(p99) / ttft_slo_s
    kept = 1.0 / tail if tail > 1.0 else 1.0  # past the target: target / p99 of the score
    return float(value) * scale * kept - TAIL_WEIGHT * scale * tail


def offered_rps(trace: Trace) -> float:
    return len(trace.requests) / trace.span_s if trace.span_s > 0 else float(len(trace.requests))


def with_weights(c: Candidate, weights: dict[str, float]) -> Candidate:
    """``c`` with these cost weights (the version bumped: a new set of weights)."""
    cost = c.router.cost.model_copy(update={**weights, "version": c.router.cost.version + 1})
    router = c.router.model_copy(update={"policy": "kvgate", "cost": cost})
    return replace(c, router=router)


@dataclass(slots=True)
class TuneResult:
    best: dict[str, float]  # the best weights not worse than the current ones (tuneguard)
    best_value: float
    current_value: float
    trials: list[dict[str, Any]]
    importance: dict[str, float]
    sensitivity: dict[str, dict[str, float]]
    pruned: int
    current: dict[str, float]  # the current weights
    figures: dict[str, Any] = field(default_factory=dict)  # guarded figures: current, best
    tradeoffs: list[dict[str, Any]] = field(default_factory=list)
    # the best against the current settings on traffic the search never saw (None: too little
    # traffic to hold any back, or the best is the current settings: nothing to validate)
    validation: dict[str, Any] | None = None

    @property
    def recommended(self) -> bool:
        """Other weights than the current ones, not worse on the held-out traffic."""
        if self.best == self.current:
            return False
        return self.validation is None or not self.validation["worse"]


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
    fit, held = split(trace)
    half = fit.head(max(1, len(fit.requests) // 2))

    def run(tr: Trace, weights: dict[str, float]) -> tuple[float, dict[str, Any]]:
        c = with_weights(current, weights)
        side = replay_side("trial", tr, c, nodes, ttft_slo_s, tpot_slo_s)
        rate = offered_rps(tr)
        return objective_value(side.metrics, objective, rate, ttft_slo_s), guarded(
            side.metrics, rate
        )

    def trial_fn(trial: Any) -> float:
        weights = _suggest(trial, space)
        trial.report(run(half, weights)[0], 0)
        if trial.should_prune():
            raise optuna.TrialPruned
        value, figures = run(fit, weights)
        trial.set_user_attr("figures", figures)
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
    trials: list[dict[str, Any]] = [
        {
            "number": t.number,
            "value": t.value,
            "params": t.params,
            "state": t.state.name,
            "figures": t.user_attrs.get("figures"),
        }
        for t in study.trials
    ]
    base = trials[0]
    current_value = float(base["value"]) if base["value"] is not None else -math.inf
    ours: dict[str, Any] = base["figures"] or {}
    # the best-scoring trial that is worse than the current settings on nothing guarded
    passed = [t for t in tradeoffs(trials, ours, top=len(trials)) if not t["worse"]]
    chosen: dict[str, Any] = (
        passed[0] if passed else {"number": 0, "value": current_value, "figures": ours}
    )
    best = dict(study.trials[int(chosen["number"])].params)
    best_value, best_figures = float(chosen["value"]), dict(chosen["figures"])
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
    probe_best: tuple[float, dict[str, float], dict[str, Any]] | None = None
    for name, p in space.items():
        row: dict[str, float] = {}
        for label, factor in (("half", 0.5), ("double", 2.0)):
            value = min(p.high, max(p.low, best[name] * factor))
            if p.integer:
                value = round(value)
            if value == best[name]:
                continue
            probe = {**best, name: value}
            got, figures = run(fit, probe)
            row[label] = round(got - best_value, 6)
            better = got > best_value and not worse(figures, ours)
            if better and (probe_best is None or got > probe_best[0]):
                probe_best = (got, probe, figures)
        sensitivity[name] = row
    if probe_best is not None:  # a one-weight step from the best was better still: take it
        best_value, best, best_figures = probe_best
    validation = None
    if held is not None and best != start:  # the winner against today's settings, on traffic
        theirs, mine = run(held, start)[1], run(held, best)[1]  # it was not tuned on
        validation = {
            "requests": len(held.requests),
            "current": theirs,
            "best": mine,
            "worse": worse(mine, theirs),
        }
    return TuneResult(
        best=best,
        best_value=best_value,
        current_value=current_value,
        trials=trials,
        importance=importance,
        sensitivity=sensitivity,
        pruned=sum(1 for t in study.trials if t.state == optuna.trial.TrialState.PRUNED),
        current=start,
        figures={"current": ours, "best": best_figures},
        tradeoffs=tradeoffs(trials, ours),
        validation=validation,
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
        "figures": result.figures,
        "tradeoffs": result.tradeoffs,
        "validation": result.validation,
        "recommended": result.recommended,
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


def verdict(t: dict[str, Any]) -> str:
    """What the search recommends, in one sentence, and why."""
    v = t.get("validation")
    if not t.get("recommended"):
        if v is not None and v["worse"]:
            return (
                f"Not recommended: on the {v['requests']} held-out requests the best weights "
                f"are worse than the current ones ({'; '.join(v['worse'])}); keep the current "
                "settings."
            )
        return "The current settings are the best found: nothing to roll out."
    held = (
        f"on the {v['requests']} held-out requests it is not worse on SLO attainment, goodput, "
        "TTFT p99, TPOT p99 or load spread"
        if v is not None
        else "(too little traffic to hold any back: not validated)"
    )
    return f"Recommended: the best weights; {held}."


def _tradeoff_rows(t: dict[str, Any]) -> list[list[str]]:
    rows = [["trial", "score", "attainment", "goodput", "TTFT p99", "TPOT p99", "worse than now"]]
    cur = t.get("figures", {}).get("current") or {}
    now = {"number": "now", "value": t["current_value"], "figures": cur, "worse": []}
    for x in [now, *(t.get("tradeoffs") or [])]:
        f = x["figures"]
        rows.append(
            [
                str(x["number"]),
                f"{x['value']:.4g}",
                f"{f['slo_attainment']:.1%}" if f.get("slo_attainment") is not None else "–",
                f"{f['goodput_rps']:.2f}" if f.get("goodput_rps") is not None else "–",
                f"{f['ttft_p99_s']:.3f} s" if f.get("ttft_p99_s") is not None else "–",
                f"{f['tpot_p99_s']:.3f} s" if f.get("tpot_p99_s") is not None else "–",
                "; ".join(x["worse"]) or "–",
            ]
        )
    return rows


def _text_table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def render_text(t: dict[str, Any]) -> str:
    lines = [_headline(t), verdict(t), ""]
    lines += _text_table(_rows(t))
    lines += ["", "The best-scoring trials, and where each is worse than the current settings:"]
    lines += _text_table(_tradeoff_rows(t))
    return "\n".join(lines)


def render_html(t: dict[str, Any]) -> str:
    """The search's section of the HTML report (trusted HTML, cells escaped)."""
    import html

    from analytics.htmlpage import table

    return (
        f"<h2>Search</h2><p>{html.escape(_headline(t))}. {html.escape(verdict(t))} "
        "Importance: PED-ANOVA over the trials; the last two columns: the objective with that "
        f"weight alone halved or doubled around the best point, minus the best.</p>"
        f"{table(_rows(t))}<p>The best-scoring trials, and where each is worse than the "
        f"current settings (a trial worse on any of them is never the best):</p>"
        f"{table(_tradeoff_rows(t))}"
    )
