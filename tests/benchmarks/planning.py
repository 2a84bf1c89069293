"""Planning figures: the engine model against published measurements, and capacity plans.

    python -m tests.benchmarks.planning [--requests 2000]

* **Calibration.** Each row puts a figure the engine model predicts (``agents/catalog.py``
  profiles, ``analytics.plan.idle_ttft_s``) next to a published measurement, with its source;
  ``calibration_max_error`` is the largest relative error over the rows that have one.
* **Plans.** ``kvgate plan`` on generated workloads: kvgate's replica count, the count one fewer,
  and round-robin's count for the same SLO, each simulated.

The simulator runs in virtual time: the figures do not depend on this machine's speed (only the
wall time of the run does). Writes ``docs/benchmarks/planning.json`` and ``planning.md``. The
autoscaling comparison and the tuner's recovered gap are ``null`` until they exist.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from agents.catalog import derive_profile, find_gpu, find_model
from analytics.plan import idle_ttft_s, parse_slo, plan

OUT = Path("docs/benchmarks")

# (what, model, gpu, prompt tokens, published seconds, source)
CALIBRATION: tuple[tuple[str, str, str, int, float, str], ...] = (
    (
        "prefill of a 1M-token prompt, 8B model, one A100",
        "llama-3.1-8b",
        "a100",
        1_000_000,
        30 * 60.0,
        "MInference 1.0 (Jiang et al., NeurIPS 2024), abstract: 30 minutes for an 8B LLM to "
        "pre-fill 1M tokens on a single A100",
    ),
)

PLANS: tuple[tuple[str, str, str, float, str], ...] = (
    ("llama-3.1-8b", "h100", "multi_turn", 100.0, "ttft=1,tpot=0.05,attainment=0.99"),
    ("llama-3.1-8b", "h100", "conversation", 4.0, "ttft=2,tpot=0.1,attainment=0.95"),
)


def calibration() -> list[dict[str, Any]]:
    rows = []
    for what, model, gpu, tokens, published, source in CALIBRATION:
        predicted = idle_ttft_s(derive_profile(find_model(model), find_gpu(gpu)), tokens)
        rows.append(
            {
                "what": what,
                "published_s": published,
                "model_s": round(predicted, 1),
                "error": round(predicted / published - 1, 4),
                "source": source,
            }
        )
    return rows


def plans(requests: int) -> list[dict[str, Any]]:
    out = []
    for model, gpu, workload, rate, slo in PLANS:
        started = time.perf_counter()
        report = plan(
            find_model(model),
            find_gpu(gpu),
            workload,
            rate=rate,
            slo=parse_slo(slo),
            requests=requests,
        )
        fleet = report["fleet"]
        out.append(
            {
                "model": model,
                "gpu": gpu,
                "workload": workload,
                "rate_rps": rate,
                "slo": slo,
                "kvgate_replicas": fleet["kvgate"]["replicas"],
                "kvgate_at_size": fleet["kvgate"]["at_size"],
                "kvgate_one_fewer": fleet["kvgate"]["one_fewer"],
                "round_robin_replicas": fleet["round_robin"]["replicas"],
                "round_robin_at_size": fleet["round_robin"]["at_size"],
                "replicas_saved": report["replicas_saved"],
                "replica": report["replica"],
                "wall_s": round(time.perf_counter() - started, 1),
            }
        )
    return out


def _pct(v: Any) -> str:
    return f"{v:.1%}" if isinstance(v, float) else "–"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Planning",
        "",
        f"Command: `{report['command']}` (virtual time: the figures do not depend on this "
        "machine's speed).",
        "",
        "## Engine model against published measurements",
        "",
        "| quantity | published | kvgate's model | error | source |",
        "|---|---|---|---|---|",
    ]
    for r in report["calibration"]:
        lines.append(
            f"| {r['what']} | {r['published_s']:,.0f} s | {r['model_s']:,.0f} s | "
            f"{r['error']:+.1%} | {r['source']} |"
        )
    lines += [
        "",
        f"`calibration_max_error` = {report['calibration_max_error']:.1%} over the rows with a "
        "published figure; `docs/engine-model.md` lists the quantities with none found yet.",
        "",
        "## Capacity plans (`kvgate plan`)",
        "",
        "| model | GPU | workload | rate | SLO | kvgate | one fewer | round robin | saved |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in report["plans"]:
        at, fewer, rr = p["kvgate_at_size"], p["kvgate_one_fewer"], p["round_robin_at_size"]
        lines.append(
            f"| {p['model']} | {p['gpu']} | {p['workload']} | {p['rate_rps']:g} req/s | "
            f"{p['slo']} | {p['kvgate_replicas']} ({_pct(at and at['slo_attainment'])}) | "
            f"{fewer and fewer['replicas']} ({_pct(fewer and fewer['slo_attainment'])}) | "
            f"{p['round_robin_replicas']} ({_pct(rr and rr['slo_attainment'])}) | "
            f"{p['replicas_saved']} |"
        )
    lines += [
        "",
        "Each count is the smallest whose simulated SLO attainment (in brackets) reaches the "
        "target; the count one fewer was simulated and missed it.",
        "",
        "## Not yet measured",
        "",
        "`gpu_hours_ratio_predictive_vs_peak`, `slo_delta_points` (autoscaling) and "
        "`tune_gap_recovered` (`kvgate tune`) are null: those parts are not built yet.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    cal = calibration()
    report: dict[str, Any] = {
        "command": "python -m tests.benchmarks.planning " + " ".join(sys.argv[1:]),
        "calibration": cal,
        "calibration_max_error": max(abs(r["error"]) for r in cal),
        "plans": plans(args.requests),
        "gpu_hours_ratio_predictive_vs_peak": None,
        "slo_delta_points": None,
        "tune_gap_recovered": None,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "planning.json").write_text(json.dumps(report, indent=2) + "\n")
    (OUT / "planning.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
