"""``livepeer.json`` and ``livepeer.md``: the live comparison's repetitions, medians and the
checks of kvgate against sglang-router (tests/benchmarks/livepeer.py runs them)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from tests.benchmarks.livepeer_workloads import (
    EVENTS_OFF,
    OUT,
    SGLANG_TUNED,
    WORKLOADS,
    Workload,
    report_header,
)

__all__ = ["checks", "medians", "write"]


KEYS = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "throughput_rps", "errors")
AGENTIC_KEYS = (
    "hit_rate",
    "tok_s_per_gpu",
    "tok_s_per_user",
    "ttft_p50_s",
    "ttft_p99_s",
    "e2e_p99_s",
    "turns",
    "errors",
)


def keys_of(name: str) -> tuple[str, ...]:
    """The figures a workload's tables show."""
    w = WORKLOADS.get(name)
    return AGENTIC_KEYS if w is not None and w.agentic is not None else KEYS


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def medians(
    reps: list[dict[str, Any]], keys: tuple[str, ...] = KEYS
) -> dict[str, dict[str, float]]:
    """Per router, the median over the repetitions of each figure."""
    routers = [r for r in reps[0]["runs"]] if reps else []
    return {
        router: {
            k: _median(
                [rep["runs"][router][k] for rep in reps if rep["runs"][router].get(k) is not None]
            )
            for k in keys
            if any(rep["runs"][router].get(k) is not None for rep in reps)
        }
        for router in routers
        if all(router in rep["runs"] for rep in reps)
    }


def _agentic_checks(
    i: int, k: dict[str, Any], peers: list[dict[str, Any]]
) -> list[tuple[str, bool]]:
    """Repetition ``i`` of the agentic workload: kvgate against the best of sglang-router's
    runs (defaults, tuned) on each figure."""

    def best(key: str, most: bool) -> float:
        values = [float(p[key] or 0.0) for p in peers]
        return max(values) if most else min(values)

    return [
        (
            f"rep {i}: tokens/s per GPU >= sglang-router's best",
            k["tok_s_per_gpu"] >= best("tok_s_per_gpu", True),
        ),
        (
            f"rep {i}: tokens/s per user >= sglang-router's best",
            (k["tok_s_per_user"] or 0.0) >= best("tok_s_per_user", True),
        ),
        (f"rep {i}: hit rate >= sglang-router's best", k["hit_rate"] >= best("hit_rate", True)),
        (
            f"rep {i}: TTFT p99 <= 0.9x sglang-router's best",
            k["ttft_p99_s"] <= 0.9 * best("ttft_p99_s", False),
        ),
    ]


def checks(name: str, reps: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The targets of kvgate at its defaults against sglang-router, per repetition, and (loaded)
    the median of kvgate against kvgate told the engines' prefill rate."""
    out: list[tuple[str, bool]] = []
    for i, rep in enumerate(reps):
        runs = rep["runs"]
        k, s = runs.get("kvgate"), runs.get("sglang_router_cache_aware")
        off = runs.get(EVENTS_OFF)
        if k is not None and off is not None:
            out.append(
                (
                    f"rep {i}: hit rate with KV events >= without them (approximate tokens)",
                    k["hit_rate"] >= off["hit_rate"],
                )
            )
        if k is None or s is None or off is not None:
            continue
        if name == "agentic":  # the criteria, against sglang-router at its best
            out += _agentic_checks(i, k, [r for n, r in runs.items() if n.startswith("sglang")])
        elif name == "loaded":
            out += [
                (f"rep {i}: TTFT p50 <= sglang-router's", k["ttft_p50_s"] <= s["ttft_p50_s"]),
                (
                    f"rep {i}: TTFT p99 <= 0.8x sglang-router's",
                    k["ttft_p99_s"] <= 0.8 * s["ttft_p99_s"],
                ),
                (f"rep {i}: hit rate >= sglang-router's", k["hit_rate"] >= s["hit_rate"]),
            ]
        else:
            for key, worse in (("ttft_p50_s", 1.05), ("ttft_p99_s", 1.05)):
                out.append(
                    (f"rep {i}: {key} within 5 % of sglang-router's", k[key] <= worse * s[key])
                )
            out.append(
                (
                    f"rep {i}: hit rate within 5 % of sglang-router's",
                    k["hit_rate"] >= 0.95 * s["hit_rate"],
                )
            )
    med = medians(reps, keys_of(name))
    if "kvgate" in med and "kvgate_told_prefill_rate" in med:
        k, t = med["kvgate"], med["kvgate_told_prefill_rate"]
        for key in ("ttft_p50_s", "ttft_p99_s"):
            out.append(
                (f"median {key} within 10 % of kvgate told the rate", k[key] <= 1.1 * t[key])
            )
        out.append(
            (
                "median hit rate within 10 % of kvgate told the rate",
                k["hit_rate"] >= 0.9 * t["hit_rate"],
            )
        )
    return out


def _table(runs: dict[str, dict[str, Any]], keys: tuple[str, ...]) -> str:
    return "\n".join(
        f"| {router} | " + " | ".join(_fmt(r.get(k)) for k in keys) + " |"
        for router, r in runs.items()
    )


def write(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    """``livepeer.json`` and ``livepeer.md``: the workloads of this run, and those of the file
    already there that this run did not repeat (each keeps its own command and date)."""
    header = report_header("tests.benchmarks.livepeer")
    path = OUT / "livepeer.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}
    kept = {
        name: {"command": earlier.get("command"), "date": earlier.get("date"), **wl}
        for name, wl in earlier.get("workloads", {}).items()
        if name in WORKLOADS and name not in results
    }
    ran = {
        name: {
            "command": header["command"],
            "date": header["date"],
            **asdict(WORKLOADS[name]),
            "repetitions": reps,
            "medians": medians(reps, keys_of(name)),
            "checks": [{"check": c, "met": met} for c, met in checks(name, reps)],
        }
        for name, reps in results.items()
    }
    workloads = {
        name: (ran.get(name) or kept[name]) for name in WORKLOADS if name in ran or name in kept
    }
    report = {**header, "engines": args.engines, "workloads": workloads}
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    (OUT / "livepeer.md").write_text(_markdown(report))


def _load(w: Workload) -> str:
    a = w.agentic
    if a is None:
        return (
            f"{w.rps} req/s for {w.duration_s} s of support-bot chat ({w.bots} system prompts of\n"
            f"~{w.system_words} words, streamed answers)"
        )
    return (
        f"{a.sessions_at_once} coding-agent sessions at once for {w.duration_s} s (a session\n"
        f"starts as one ends; `tests/benchmarks/liveagentic.py`): AIPerf's agentic trace with\n"
        f"token counts ÷ {a.token_scale:g}, outputs ÷ {a.output_scale:g} and tool delays ÷ "
        f"{a.delay_scale:g}, each turn\nthe whole conversation so far, its session in "
        "`x-session-id`"
    )


def _markdown(report: dict[str, Any]) -> str:
    parts = []
    for name, wl in report["workloads"].items():
        w, reps = WORKLOADS[name], wl["repetitions"]
        keys = keys_of(name)
        head = f"| router | {' | '.join(keys)} |\n|---|{'---:|' * len(keys)}"
        speed = (
            f"prefill {w.prefill_tokens_per_s:,.0f} tokens/s"
            if w.prefill_tokens_per_s
            else "the profile's prefill speed"
        )
        tables = "\n\n".join(
            f"Repetition {i} (seed {rep['seed']}, fresh engines; in the order "
            f"{', '.join(rep.get('order') or rep['runs'])}):\n\n{head}\n{_table(rep['runs'], keys)}"
            for i, rep in enumerate(reps)
        )
        met = "\n".join(f"* {'met' if ok else '**not met**'}: {c}" for c, ok in checks(name, reps))
        parts.append(
            f"""## {name}: {w.about}

Command: `{wl["command"]}` ({wl["date"]})

{_load(w)}; engines with {w.num_gpu_blocks} KV blocks of 16 tokens and {speed}.

Median over {len(reps)} repetitions:

{head}
{_table(medians(reps, keys), keys)}

{met}

{tables}
"""
        )
    return f"""# Live: kvgate's router next to SGLang's model gateway

Machine: {report["machine"]}; sglang-router
{report["sglang_router_version"]} (`--policy cache_aware`, its defaults). {report["engines"]}
simulated engines per workload and repetition, fresh for each repetition (the process starts
over: engines, agents, worker, routers), the same engines for every router of a repetition
(prefix caches reset in between). Everything — engines, agents, Kafka, the Faust worker, the
routers and the client — shares the machine's cores, so absolute latencies carry that noise;
compare the rows. `kvgate` runs at its defaults (the engines' prefill rate as its agents
measured it when they started, then as it learns it from its first streamed answers);
`kvgate_told_prefill_rate` (on workloads whose engines are slower than that) is told the
engines' rate in its configuration, as an operator who measured them would. The routers of a
repetition run in an order rotated from one repetition to the next. `approx`: the engines
tokenize with a BPE tokenizer the router is not given (nor finds), so its tokens are
approximate and the index (the engines' exact tokens) cannot match them; `kvgate` runs with
the agents' KV events flowing, `kvgate_events_off` without them (`--no-kv-events`); each of
the two starts with the agents started again and a fresh router, in the rotated order.
`agentic`: coding-agent sessions in closed loop (`tests/benchmarks/liveagentic.py`), so a router
that serves turns faster gets more turns through the same engines in the same time;
`sglang_router_tuned` is sglang-router with its load balancing brought down to a few sessions
(`{" ".join(SGLANG_TUNED)}`: at its defaults it balances only between workers more than 64
requests apart, and every session follows the system prompt they share to one worker).

""" + "\n".join(parts)


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
