"""Admission control: decision latency (in-process and Redis stores, same run) and overload
experiments on the simulated cluster (2× and 3× capacity, mixed priorities, admission off and
on with several slot budgets).

    python -m tests.benchmarks.admission [--decisions 20000] [--overload-requests 6000]

Each decision is what a router does per request: the budget snapshot from the store, the pure
verdict, the atomic check-and-reserve; then the release (timed separately). Needs Redis
(``deploy/local/redis.sh start``). Writes ``docs/benchmarks/admission.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from admission.gate import AdmissionGate
from admission.redis_store import RedisReservations
from admission.reservations import ReservationStore
from admission.settings import AdmissionSettings, Tenant
from streams.schemas import LedgerEvent
from tests.factories import admit

OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
TRACES = Path(__file__).resolve().parents[2] / "traces"
NODES = [26_972] * 16


async def _noop(_: LedgerEvent) -> None:
    return None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(store: ReservationStore, n: int) -> dict[str, float]:
    gate = AdmissionGate(AdmissionSettings(), "bench", _noop, store)
    tenant = Tenant(name="t", priority="normal")
    admit_ms: list[float] = []
    release_ms: list[float] = []
    for i in range(n):
        now = time.time()
        t0 = time.perf_counter()
        v = await admit(gate, f"r{i}", tenant, 2000, 256, 16, "default", NODES, now)
        t1 = time.perf_counter()
        assert v.admitted
        await gate.release(f"r{i}", now)
        t2 = time.perf_counter()
        admit_ms.append((t1 - t0) * 1000)
        release_ms.append((t2 - t1) * 1000)
    return {
        "admit_p50_ms": round(pct(admit_ms, 0.5), 4),
        "admit_p99_ms": round(pct(admit_ms, 0.99), 4),
        "release_p50_ms": round(pct(release_ms, 0.5), 4),
        "release_p99_ms": round(pct(release_ms, 0.99), 4),
    }


def overload(requests: int, slots: list[int], loads: list[float], nodes: int) -> dict[str, Any]:
    """Every combination of workload, load and admission (off, or on with a slot budget)."""
    from dataclasses import replace as dc_replace

    from analytics.sim.overload import PRIORITY_MIX, overload_run, with_priorities
    from analytics.sim.replay import capacity_rps, open_trace
    from analytics.sim.simconfig import SimConfig

    sources = [str(TRACES / "azure_llm_inference_2023_conv.csv"), "shared_prompt"]
    runs = []
    caps = {}
    for source in sources:
        trace = with_priorities(open_trace(source, limit=requests))
        cap = capacity_rps(trace, dc_replace(SimConfig(), nodes=nodes))
        caps[trace.name] = cap
        for load in loads:
            for slot in [None, *slots]:
                adm = None if slot is None else AdmissionSettings(slots_per_node=slot)
                r = overload_run(trace, capacity_rps=cap, load=load, nodes=nodes, admission=adm)
                r["slots_per_node"] = slot
                runs.append(r)
                print(trace.name, load, slot, round(r["goodput_rps"], 1), flush=True)
    return {
        "capacity_rps": caps,
        "priority_mix": dict(PRIORITY_MIX),
        "nodes": nodes,
        "requests": requests,
        "runs": runs,
    }


def retry_storm(requests: int, nodes: int, load: float = 1.3) -> dict[str, Any]:
    """No storm / a storm client with the guard / the same storm without the guard."""
    from dataclasses import replace as dc_replace

    from analytics.sim.replay import capacity_rps, open_trace
    from analytics.sim.simconfig import SimConfig
    from analytics.sim.stormrun import storm_run, with_clients

    runs = []
    for source in (str(TRACES / "azure_llm_inference_2023_conv.csv"), "shared_prompt"):
        trace = with_clients(open_trace(source, limit=requests))
        cap = capacity_rps(trace, dc_replace(SimConfig(), nodes=nodes))
        for storm, guard in ((False, True), (True, True), (True, False)):
            r = storm_run(trace, capacity_rps=cap, load=load, nodes=nodes, storm=storm, guard=guard)
            r["trace"] = trace.name
            runs.append(r)
            print("storm", trace.name, storm, guard, flush=True)
    return {"load": load, "nodes": nodes, "requests": requests, "runs": runs}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from admission.reservations import InProcessReservations

    if args.overload_only:
        return {
            "overload": overload(
                args.overload_requests, args.slots, args.loads, args.overload_nodes
            ),
            "retry_storm": retry_storm(args.overload_requests, args.overload_nodes),
        }

    inproc = await measure(InProcessReservations(), args.decisions)
    client = Redis.from_url(args.redis)
    try:
        store = RedisReservations(client, f"bench:{uuid.uuid4().hex[:8]}")
        await store.mark_generation("bench")  # what a router's reconciler does on a fresh Redis
        redis = await measure(store, args.decisions)
    finally:
        await client.aclose()
    return {
        "command": "python -m tests.benchmarks.admission " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "decisions": args.decisions,
        "inproc_p99_ms": inproc["admit_p99_ms"],
        "redis_p99_ms": redis["admit_p99_ms"],
        "inproc": inproc,
        "redis": redis,
        "overload": overload(args.overload_requests, args.slots, args.loads, args.overload_nodes),
        "retry_storm": retry_storm(args.overload_requests, args.overload_nodes),
    }


def write(r: dict[str, Any]) -> None:
    if "inproc" not in r:  # overload only: keep the latency numbers of the last full run
        old = json.loads((OUT / "admission.json").read_text())
        r = {
            **old,
            **r,
            "overload_command": "python -m tests.benchmarks.admission " + " ".join(sys.argv[1:]),
        }
    (OUT / "admission.json").write_text(json.dumps(r, indent=2) + "\n")
    lines = [
        "# Admission decision latency",
        "",
        f"Command: `{r['command']}`  ",
        f"Machine: {r['machine']}; date {r['date']}; {r['decisions']} sequential decisions per "
        "backend, 16 nodes in the budget. A decision = budget snapshot from the store + the pure "
        "verdict + the atomic check-and-reserve (the release is timed apart).",
        "",
        "| backend | admit p50 ms | admit p99 ms | target p99 | release p50 ms | release p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
        f"| in-process | {r['inproc']['admit_p50_ms']} | {r['inproc']['admit_p99_ms']} | ≤ 0.5 | "
        f"{r['inproc']['release_p50_ms']} | {r['inproc']['release_p99_ms']} |",
        f"| Redis (loopback, Lua) | {r['redis']['admit_p50_ms']} | {r['redis']['admit_p99_ms']} | "
        f"≤ 2 | {r['redis']['release_p50_ms']} | {r['redis']['release_p99_ms']} |",
        "",
        "The Redis path is two round trips: one pipeline for the budget snapshot (HMGET of the "
        "held totals, MGET of the per-5-s release counters for the drain rate) and the "
        "EVALSHA of the check-and-reserve script.",
        "",
    ]
    if "overload" in r:
        lines += _overload_md(r)
    if "retry_storm" in r:
        lines += _storm_md(r["retry_storm"])
    (OUT / "admission.md").write_text("\n".join(lines))


def _f(v: Any) -> str:
    if v is None:
        return "–"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _storm_md(o: dict[str, Any]) -> list[str]:
    lines = [
        "# Retry storm",
        "",
        f"{o['nodes']} simulated engines, {o['requests']} requests per run at {o['load']}× "
        "capacity, spread over ten clients; admission with 64 slots per node and no queue "
        "(every refusal goes back to its client). Well-behaved clients retry after the "
        "Retry-After they got, up to 4 attempts; the storm client (`c0`, a tenth of the "
        "requests) retries 50 ms after every refusal, up to 40 attempts. `gave up` = share of "
        "requests never admitted after all attempts.",
        "",
        "| workload | storm client | guard | well-behaved: gave up | well-behaved: TTFT p99 s | "
        "storm client: attempts / requests | storm: gave up | retry_storm refusals |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for run in o["runs"]:
        w, st = run["well_behaved"], run["storm_client"]
        lines.append(
            f"| {run['trace']} | {'yes' if run['storm'] else 'no'} | "
            f"{'on' if run['guard'] else 'off'} | {w['gave_up_rate']:.3f} | "
            f"{_f(w['ttft_p99_s'])} | "
            f"{st['attempts'] / max(1, st['requests']):.1f} | {st['gave_up_rate']:.3f} | "
            f"{st['retry_storm_refusals']} |"
        )
    lines.append("")
    return lines


def _overload_md(r: dict[str, Any]) -> list[str]:
    o = r["overload"]
    mix = ", ".join(f"{k} {v:.0%}" for k, v in o["priority_mix"].items())
    caps = ", ".join(f"{k} {v:.0f} req/s" for k, v in o["capacity_rps"].items())
    lines = [
        "# Overload: admission control on the simulated cluster",
        "",
        f"Command: `{r.get('overload_command', r['command'])}`",
        "",
        f"{o['nodes']} simulated engines, kvgate routing, {o['requests']} requests per run; "
        "arrivals compressed to 2× and 3× the cluster's "
        f"capacity (saturated throughput: {caps}); priorities {mix} (fixed per request). "
        "SLO: TTFT ≤ 2 s (including time in the admission queue) and TPOT ≤ 0.1 s. "
        "`attained/completed` counts the requests that ran; `attained/offered` counts a "
        "refusal as a miss. Admission runs with the default watermarks (yellow 80 %, red 90 %) "
        "and queue limits (high 30 s, normal 10 s, low never queues); the budget is the KV "
        "blocks of the nodes and `slots_per_node` concurrent requests per node — the knob that "
        "decides how much of the saturated throughput is let in.",
        "",
        "| workload | load | admission | priority | offered | completed | refused (reason) | "
        "no Retry-After | queued | attained/completed | attained/offered | TTFT p99 s |",
        "|---|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for run in o["runs"]:
        adm = "off" if run["slots_per_node"] is None else f"{run['slots_per_node']} slots/node"
        for prio, x in run["by_priority"].items():
            reasons = ", ".join(f"{k} {v}" for k, v in x["refused_by_reason"].items())
            lines.append(
                f"| {run['trace']} | {run['load']}× | {adm} | {prio} | {x['offered']} | "
                f"{x['completed']} | {x['refused']} {('(' + reasons + ')') if reasons else ''} | "
                f"{x['refusals_without_retry_after']} | {x['queued']} | "
                f"{_f(x['slo_attainment_completed'])} | {_f(x['slo_attainment_offered'])} | "
                f"{_f(x['ttft_p99_s'])} |"
            )
    lines.append("")
    return lines


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--redis", default=os.environ.get("KVGATE_TEST_REDIS", "redis://127.0.0.1:16379/0")
    )
    p.add_argument("--decisions", type=int, default=20_000)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--overload-only", action="store_true", help="skip the latency part")
    p.add_argument("--overload-requests", type=int, default=8000)
    p.add_argument("--overload-nodes", type=int, default=4)
    p.add_argument("--slots", type=lambda v: [int(x) for x in v.split(",")], default=[48, 64, 96])
    p.add_argument("--loads", type=lambda v: [float(x) for x in v.split(",")], default=[2.0, 3.0])
    args = p.parse_args()
    result = asyncio.run(main(args))
    if not args.no_write:
        write(result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli()
