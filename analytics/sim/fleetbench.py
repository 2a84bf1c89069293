"""``kvgate bench fleet``: the fleet rules (router/decision/fleet.py) on a simulated cluster, each
against the same run without them. Writes ``fleet.json`` (every number) and ``fleet.md``.

Scenarios, all with the ``kvgate`` policy on the same trace at the same load:

* ``broken_node``: one engine answers every request with 500 from the start while its metrics
  look fine — without outlier ejection, and with the defaults (Envoy's);
* ``flaky_node``: one engine fails 30 % of its requests — consecutive errors rarely line up, so
  this is the success-rate test's case (default volume 100 per interval, and 10);
* ``scale_up``: a quarter more nodes join cold halfway through — without and with slow start;
* ``drain``: two nodes drained a third of the way in, undrained at two thirds;
* ``slo_mix``: 30 % interactive and 70 % batch requests at 120 % load on 16 nodes, per workload:
  today's priorities alone (interactive high, batch low) against the SLO classes (interactive
  and batch, admission.slo_classes) — each class's SLO attainment among completed requests, what
  was completed and refused, and whether every refusal carried a Retry-After;
* ``fair_share``: three tenants of weights 1, 2, 4 in two priority bands at 150 % load, each
  tenant's share per 60 s window against its weighted max-min share (analytics/sim/fairbench.py);
* ``preemption``: a batch tenant (sheddable) keeping a KV-bound pool busy, an interactive burst
  on top, with and without preemption (analytics/sim/preemptbench.py);
* ``scale_from_zero``: a pool started at zero whose engines are ready 30 s after the first
  request, with the waiting room and without it (analytics/sim/zerobench.py); ``burst``: the
  same at twice the load on a short trace, where the backlog released at once outgrows what
  admission can queue.
"""

from __future__ import annotations

import json
import os
import platform
import time
import zlib
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from admission.settings import DEFAULT_SLO_CLASSES, AdmissionSettings
from analytics.progress import status
from analytics.sim.admission import Refused
from analytics.sim.bench_report import fmt
from analytics.sim.cluster import simulate
from analytics.sim.fairbench import fair_section, fair_share
from analytics.sim.metrics import run_metrics
from analytics.sim.preemptbench import preempt_section, preemption
from analytics.sim.replay import capacity_rps, open_trace
from analytics.sim.simconfig import Done, FleetOp, SimConfig, node_names, with_router
from analytics.sim.traces import Trace
from analytics.sim.zerobench import scale_from_zero, zero_section
from router.decision.policies import make_policy
from router.decision.weights import OutlierSettings, SlowStartSettings
from router.settings import RouterSettings

__all__ = ["bench_fleet"]

ON = OutlierSettings()
OFF = OutlierSettings(enabled=False)
NO_SLOW = SlowStartSettings(window_s=0)


def _run(trace: Trace, cfg: SimConfig, since_s: float | None = None) -> dict[str, Any]:
    settings = RouterSettings(policy="kvgate")
    cfg = with_router(cfg, settings)
    stats: dict[str, int] = {}
    done = simulate(trace, make_policy(settings), cfg, stats)
    window = [d for d in done if since_s is None or d.request.arrival_s >= since_s]
    m = run_metrics(window, len(node_names(cfg)), trace.block_size)
    span = max(1e-9, trace.span_s)
    return {
        "requests": len(trace.requests),
        "finished": len(done),
        "failed": stats.get("failed", 0),
        "failed_share": round(stats.get("failed", 0) / len(trace.requests), 4),
        "ejections": stats.get("ejections", 0),
        "ttft_p50_s": m.get("ttft_p50_s"),
        "ttft_p99_s": m.get("ttft_p99_s"),
        "hit_rate": m.get("hit_rate"),
        "slo_attainment": m.get("slo_attainment"),
        "goodput_rps": round(len(done) / span, 3),
    }


SLO_WORKLOADS = ("multi_turn", "shared_prompt", "long_tail")
INTERACTIVE_SHARE = 0.3


def _with_classes(trace: Trace, classes: bool) -> Trace:
    """30 % interactive, the rest batch: SLO classes, or (``classes`` False) only the
    priorities an operator would give them without classes (high and low)."""
    out = []
    for i, r in enumerate(trace.requests):
        inter = (zlib.crc32(f"slo{i}".encode()) % 1000) / 1000 < INTERACTIVE_SHARE
        if classes:  # a request runs at its class's priority (admission/slo.py)
            cls = "interactive" if inter else "batch"
            r = replace(r, slo_class=cls, priority=DEFAULT_SLO_CLASSES[cls].priority)
        else:
            r = replace(r, priority="high" if inter else "low")
        out.append(replace(r, client="interactive" if inter else "batch"))
    return Trace(trace.name, trace.block_size, tuple(out))


def _met(d: Done, ttft_s: float, tpot_s: float) -> bool:
    out = d.request.output_tokens
    return d.first_token_s - d.request.arrival_s <= ttft_s and (
        out <= 1 or (d.finish_s - d.first_token_s) / (out - 1) <= tpot_s
    )


def slo_mix(name: str, *, nodes: int, requests: int, load: float) -> dict[str, Any]:
    """The ``slo_mix`` rows of one workload: without and with SLO classes."""
    adm = AdmissionSettings()
    trace0 = open_trace(name, limit=requests)
    cap = capacity_rps(trace0, SimConfig(nodes=nodes))
    rate = len(trace0.requests) / max(1e-9, trace0.span_s)
    settings = RouterSettings(policy="kvgate")
    cfg = with_router(SimConfig(nodes=nodes, admission=adm), settings)
    out: dict[str, Any] = {"capacity_rps": round(cap, 3)}
    for label, classes in (("priorities", False), ("slo_classes", True)):
        trace = _with_classes(trace0, classes).scaled(rate / (load * cap))
        refused: list[Refused] = []
        done = simulate(trace, make_policy(settings), cfg, refused_out=refused)
        row: dict[str, Any] = {}
        for cls in ("interactive", "batch"):
            target = adm.slo_classes[cls]
            mine = [d for d in done if d.request.client == cls]
            gone = [r for r in refused if r.final and trace.requests[r.index].client == cls]
            offered = sum(1 for r in trace.requests if r.client == cls)
            met = sum(1 for d in mine if _met(d, target.ttft_s, target.tpot_s))
            row[cls] = {
                "offered": offered,
                "completed": len(mine),
                "slo_attainment": round(met / len(mine), 4) if mine else None,
                "refused": len(gone),
                "refused_by_reason": dict(Counter(str(r.reason) for r in gone)),
                "refusals_without_retry_after": sum(1 for r in gone if not r.retry_after_s),
            }
        out[label] = row
    return out


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


PD_WORKLOADS = ("long_tail", "multi_turn")
PD_SPLITS = (
    ("colocated", 0, 0, True),
    ("pd_8p_8d", 8, 8, True),
    ("pd_12p_4d", 12, 4, True),
    ("mixed_8_4p_4d", 4, 4, True),
    ("mixed_8_4p_4d_never_split", 4, 4, False),
)


def pd_vs_colocated(
    name: str, *, nodes: int = 16, requests: int = 4000, load: float = 0.7
) -> dict[str, Any]:
    """The same requests on ``nodes`` engines: all colocated, split into prefill and decode
    pools of several sizes, and mixed nodes beside small pools (the cost model chooses per
    request). Load is relative to the colocated fleet's capacity."""
    trace0 = open_trace(name, limit=requests)
    base = SimConfig(nodes=nodes)
    cap = capacity_rps(trace0, base)
    rate = len(trace0.requests) / max(1e-9, trace0.span_s)
    trace = trace0.scaled(rate / (load * cap))
    settings = RouterSettings(policy="kvgate")
    names = node_names(base)
    out: dict[str, Any] = {"capacity_rps": round(cap, 3), "load": load}
    for label, n_pre, n_dec, split_ok in PD_SPLITS:
        roles = tuple((n, "prefill") for n in names[:n_pre]) + tuple(
            (n, "decode") for n in names[n_pre : n_pre + n_dec]
        )
        cfg = with_router(replace(base, roles=roles, disaggregation=split_ok), settings)
        with status(f"fleet: pd_vs_colocated/{name}/{label}"):
            done = simulate(trace, make_policy(settings), cfg)
        m = run_metrics(done, nodes, trace.block_size)
        split = m["reasons"].get("disaggregated", 0)
        out[label] = {
            "prefill_nodes": n_pre,
            "decode_nodes": n_dec,
            "mixed_nodes": nodes - n_pre - n_dec,
            "disaggregated_share": round(split / max(1, len(done)), 4),
            **{
                k: m.get(k)
                for k in (
                    "ttft_p50_s",
                    "ttft_p99_s",
                    "tpot_p50_s",
                    "tpot_p99_s",
                    "slo_attainment",
                    "goodput_rps",
                )
            },
        }
    return out


def bench_fleet(
    *, out_dir: Path, command: str, nodes: int = 8, requests: int = 20_000, load: float = 0.8
) -> dict[str, Any]:
    started = time.time()
    trace0 = open_trace("multi_turn", limit=requests)
    base = SimConfig(nodes=nodes, outlier=OFF, slow_start=NO_SLOW)
    cap = capacity_rps(trace0, base)
    rate = len(trace0.requests) / max(1e-9, trace0.span_s)
    trace = trace0.scaled(rate / (load * cap))
    t0, span = trace.requests[0].arrival_s, trace.span_s
    names = node_names(base)
    rows: dict[str, dict[str, Any]] = {}

    def run(name: str, cfg: SimConfig, since_s: float | None = None) -> None:
        with status(f"fleet: {name}"):
            rows[name] = _run(trace, cfg, since_s)

    broken = ((names[3], 1.0),)
    run("broken_node/no_ejection", replace(base, faults=broken))
    run("broken_node/ejection", replace(base, faults=broken, outlier=ON))
    flaky = ((names[3], 0.3),)
    run("flaky_node/no_ejection", replace(base, faults=flaky))
    run("flaky_node/ejection", replace(base, faults=flaky, outlier=ON))
    low_volume = OutlierSettings(success_rate_request_volume=10)
    run("flaky_node/ejection_volume_10", replace(base, faults=flaky, outlier=low_volume))
    join_at = t0 + span / 2
    joins = tuple(FleetOp(join_at, "join", f"new-{i:02d}") for i in range(max(1, nodes // 4)))
    scale = replace(base, ops=joins)
    run("scale_up/no_slow_start", scale, join_at)
    run("scale_up/slow_start_60s", replace(scale, slow_start=SlowStartSettings()), join_at)
    drains = tuple(FleetOp(t0 + span / 3, "drain", n) for n in names[:2]) + tuple(
        FleetOp(t0 + span * 2 / 3, "undrain", n) for n in names[:2]
    )
    run("drain/none", base)
    run("drain/two_nodes", replace(base, ops=drains))
    pd = {name: pd_vs_colocated(name) for name in PD_WORKLOADS}
    hol = long_tail_isolation()
    at80 = hol["load_0.8"]["lanes"]
    with status("fleet: fair_share"):
        fair = fair_share()
    with status("fleet: preemption"):
        preempt = preemption()
    with status("fleet: scale_from_zero"):
        zero = scale_from_zero(nodes=4, load=0.3, requests=6000, start_delay_s=30.0)
        zero["burst"] = scale_from_zero(nodes=4, load=0.6, requests=2000, start_delay_s=30.0)
    slo: dict[str, Any] = {}
    for name in SLO_WORKLOADS:
        with status(f"fleet: slo_mix/{name}"):
            slo[name] = slo_mix(name, nodes=16, requests=6000, load=1.2)

    result = {
        "command": command,
        "trace": trace.name,
        "nodes": nodes,
        "load": load,
        "capacity_rps": round(cap, 3),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "wall_s": round(time.time() - started, 1),
        "rows": rows,
        "slo_mix": slo,
        "scale_from_zero": zero,
        "fair_share": fair,
        "preemption": preempt,
        "pd_vs_colocated": pd,
        "long_tail": hol,
        "long_tail_short_ttft_p99_ratio": at80["short_ttft_p99_ratio"],
        "long_tail_throughput_ratio": at80["throughput_ratio"],
        "long_tail_long_tpot_p99_ratio": at80["long_tpot_p99_ratio"],
        "slo_interactive_at_120": {
            name: r["slo_classes"]["interactive"]["slo_attainment"] for name, r in slo.items()
        },
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fleet.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "fleet.md").write_text(_markdown(result))
    return result


def _markdown(r: dict[str, Any]) -> str:
    cols = (
        "failed",
        "failed_share",
        "ejections",
        "ttft_p50_s",
        "ttft_p99_s",
        "hit_rate",
        "slo_attainment",
        "goodput_rps",
    )
    lines = [
        "# Fleet operations in simulation",
        "",
        f"`{r['command']}` — {r['trace']}, {r['nodes']} nodes at {r['load']:.0%} of capacity "
        f"({r['capacity_rps']} req/s), `kvgate` policy; {r['machine']}, {r['wall_s']} s.",
        "",
        "Each scenario against the same run without the rule (analytics/sim/fleetbench.py). "
        "`scale_up` rows count only requests that arrived after the join.",
        "",
        "| scenario | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for name, row in r["rows"].items():
        lines.append(f"| {name} | " + " | ".join(fmt(row.get(c)) for c in cols) + " |")
    lines += _slo_section(r) + _long_tail_section(r) + _pd_section(r) + zero_section(r)
    lines += fair_section(r) + preempt_section(r)
    lines += _reading()
    return "\n".join(lines) + "\n"


def _slo_section(r: dict[str, Any]) -> list[str]:
    """The SLO classes at 120 % load."""
    lines = [
        "",
        "## SLO classes at 120 % load",
        "",
        "30 % interactive (TTFT 2 s, TPOT 0.1 s) and 70 % batch (TTFT 600 s, TPOT 1 s) requests, "
        "16 nodes, 6,000 requests per workload. `priorities`: today's admission with interactive "
        "high and batch low; `slo_classes`: the default classes (interactive high; batch normal, "
        "queueing up to its TTFT, routed with queue weight 0.3 and held in the router while its "
        "best node has more than 0.1 s queued). Attainment is among completed requests.",
        "",
        "| workload | run | class | offered | completed | SLO attainment | refused | "
        "refusals by reason | without Retry-After |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, runs in r["slo_mix"].items():
        for label in ("priorities", "slo_classes"):
            for cls, v in runs[label].items():
                lines.append(
                    f"| {name} | {label} | {cls} | {v['offered']} | {v['completed']} | "
                    f"{fmt(v['slo_attainment'])} | {v['refused']} | "
                    f"{v['refused_by_reason'] or '–'} | {v['refusals_without_retry_after']} |"
                )
    return lines


def _long_tail_section(r: dict[str, Any]) -> list[str]:
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


def _pd_section(r: dict[str, Any]) -> list[str]:
    """Prefill/decode disaggregation against colocated serving."""
    lines = [
        "",
        "## Prefill/decode disaggregation against colocated serving",
        "",
        "16 engines in every row, 4,000 requests at 70 % of the colocated fleet's capacity, "
        "`kvgate` policy, KV moved at 100 Gbit/s (128 KiB per token). `mixed_8_4p_4d`: eight "
        "mixed nodes beside four prefill and four decode nodes; the cost model splits a request "
        "only when the split costs less (`disaggregated share`).",
        "",
        "| workload | fleet | disaggregated share | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | "
        "SLO attainment | goodput (req/s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in r.get("pd_vs_colocated", {}).items():
        for label, v in runs.items():
            if not isinstance(v, dict):
                continue
            lines.append(
                f"| {name} | {label} | {fmt(v['disaggregated_share'])} | "
                f"{fmt(v['ttft_p50_s'])} | {fmt(v['ttft_p99_s'])} | {fmt(v['tpot_p50_s'])} | "
                f"{fmt(v['tpot_p99_s'])} | {fmt(v['slo_attainment'])} | "
                f"{fmt(v['goodput_rps'])} |"
            )
    return lines


def _reading() -> list[str]:
    """How to read the page."""
    return [
        "",
        "How to read it:",
        "",
        "* A broken engine that fails fast looks idle, so a load-aware router feeds it more than "
        "its share (the `no_ejection` row's failed share is far above 1 / nodes). Ejection stops "
        "that after `consecutive_errors`; each ejection ends with one probe, which fails while "
        "the engine is still broken and doubles the next ejection.",
        "* A flaky engine (30 % errors) rarely fails five times in a row; the success-rate test "
        "catches it once nodes carry `success_rate_request_volume` requests per interval. Lower "
        "the volume for small fleets or low rates (the `volume_10` row).",
        "* `scale_up`: cost-based routing already sends a cold node only what it can take, so "
        "slow start changes little here (measured with the kvgate policy only).",
        "* `drain`: nothing fails; the remaining nodes absorb the drained nodes' share.",
        "* `slo_mix`: with priorities alone, interactive requests on `long_tail` miss their TTFT "
        "although admitted first: the KV budget is not what runs out, the engines' compute is, "
        "and batch work already queued in the engines delays them. Holding batch in the router "
        "while engines are queued keeps interactive within its target and lets batch use the "
        "rest (more batch completes than when low priority is refused above yellow).",
        "* `pd_vs_colocated`: disaggregation removes prefill interference from decoding (TPOT "
        "drops several-fold with 8 + 8) but loses on TTFT and goodput at these sizes: the "
        "prefill pool carries every prompt (the simulated engine prefills 25k tokens/s, and "
        "these workloads are prefill-heavy), and the decode pool holds every running "
        "sequence's KV in half the fleet's memory, so requests wait for blocks there. The "
        "mixed fleet (8 mixed + 4 + 4) has only half its nodes for whole requests; compare its "
        "cost-model choice with `never_split` on the same fleet (the pools then sit idle: "
        "mixed nodes serve every request) to see what the per-request choice is worth.",
        "* `long_tail`: in overload the engines' own queues are where short requests lose: "
        "every engine is full (256 sequences, KV near its limit, preempting), and a short "
        "request waits behind everything sent before it. With the lane rules the router keeps "
        "each engine's queue short (at most ~1 s of prefill) and queues the rest itself, short "
        "requests first: short TTFT p99 drops, throughput rises (engines stop preempting) and "
        "long requests decode faster once running. At a sustainable load the rules rarely "
        "hold anything and change little. A lane of nodes for long prompts costs short "
        "requests capacity on this workload (long prompts are a few percent of requests), so "
        "it is off by default.",
    ]
