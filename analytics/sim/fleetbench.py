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
  was completed and refused, and whether every refusal carried a Retry-After
  (analytics/sim/slobench.py);
* ``long_tail``: long requests against short ones, with and without the lane rules
  (analytics/sim/lanebench.py); ``pd_vs_colocated``: prefill/decode pools against colocated
  engines (analytics/sim/pdbench.py);
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
from dataclasses import replace
from pathlib import Path
from typing import Any

from analytics.progress import status
from analytics.sim.bench_report import fmt
from analytics.sim.cluster import simulate
from analytics.sim.fairbench import fair_section, fair_share
from analytics.sim.lanebench import long_tail_isolation, long_tail_section
from analytics.sim.metrics import run_metrics
from analytics.sim.pdbench import PD_WORKLOADS, pd_section, pd_vs_colocated
from analytics.sim.preemptbench import preempt_section, preemption
from analytics.sim.replay import capacity_rps, open_trace
from analytics.sim.simconfig import FleetOp, SimConfig, node_names, with_router
from analytics.sim.slobench import SLO_WORKLOADS, slo_mix, slo_section
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
    lines += slo_section(r) + long_tail_section(r) + pd_section(r) + zero_section(r)
    lines += fair_section(r) + preempt_section(r)
    lines += _reading()
    return "\n".join(lines) + "\n"


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
