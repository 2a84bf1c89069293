"""Pipeline benchmark: how many simulated nodes the pipeline carries with events visible in a
router replica within 1 s (p99), and the router's TTFT overhead.

    python -m tests.benchmarks.pipeline [--nodes 50,100,200,400,700,1000] [--duration 20]

Needs Kafka (``deploy/kafka/kafka.sh start``). Writes ``docs/benchmarks/pipeline.json`` and
``docs/benchmarks/pipeline.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from deploy.procs import Supervisor, free_port
from streams.kafka import KafkaBus, ensure_topics
from streams.replica import TableReplica
from streams.schemas import Heartbeat
from streams.settings import KafkaSettings, WorkerSettings
from streams.topics import HEARTBEATS
from tests.benchmarks.loadgen import produced_ms
from tests.factories import heartbeat

OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def freshness_step(
    kafka: KafkaSettings,
    worker: WorkerSettings,
    sup: Supervisor,
    replica: TableReplica,
    nodes: int,
    duration: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    prefix = f"s{nodes}-"
    hb_lat: list[float] = []
    kv_lat: list[float] = []
    warm = time.time() + args.warmup

    def on_load(hb: Heartbeat, now: float) -> None:
        if hb.node_id.startswith(prefix) and hb.ts >= warm:
            hb_lat.append(now - hb.ts)

    def on_block(node: str, block: int, now: float) -> None:
        if node.startswith(prefix):
            t = produced_ms(block) / 1000
            if t >= warm:
                kv_lat.append(now - t)

    replica.on_load, replica.on_block = on_load, on_block
    worker_pid = sup.procs["worker"].pid
    cpu0, self0, t0 = cpu_s(worker_pid), time.process_time(), time.monotonic()
    gen = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.benchmarks.loadgen",
        "--bootstrap",
        kafka.bootstrap_servers,
        "--namespace",
        kafka.namespace,
        "--prefix",
        prefix,
        "--nodes",
        str(nodes),
        "--duration",
        str(duration),
        "--stored",
        str(args.stored),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await gen.communicate()
    gen_stats = json.loads(out.decode().strip().splitlines()[-1])
    produced_blocks = nodes * args.stored * int(duration / 0.1)
    # let the pipeline drain; a backlog shows up as a long drain and a high p99
    drain_start = time.monotonic()
    last = -1
    while time.monotonic() - drain_start < args.drain_limit:
        await asyncio.sleep(0.5)
        if len(kv_lat) == last:
            break
        last = len(kv_lat)
    wall = time.monotonic() - t0
    result = {
        "nodes": nodes,
        "duration_s": duration,
        "offered_msgs_per_s": round(gen_stats["msgs_per_s"], 1),
        "offered_block_changes_per_s": nodes * args.stored * 2 / 0.1,
        "loadgen_lag_max_s": round(gen_stats["producer_lag_max_s"], 3),
        "heartbeat_samples": len(hb_lat),
        "heartbeat_p50_ms": _ms(pct(hb_lat, 0.5)),
        "heartbeat_p99_ms": _ms(pct(hb_lat, 0.99)),
        "block_samples": len(kv_lat),
        "block_p50_ms": _ms(pct(kv_lat, 0.5)),
        "block_p99_ms": _ms(pct(kv_lat, 0.99)),
        "blocks_seen_ratio": round(
            len(kv_lat) / max(1, produced_blocks * (1 - args.warmup / duration)), 3
        ),
        "drain_s": round(time.monotonic() - drain_start, 1),
        "worker_cpu_share": round((cpu_s(worker_pid) - cpu0) / wall, 2),
        "replica_cpu_share": round((time.process_time() - self0) / wall, 2),
    }
    both = [v for v in (result["heartbeat_p99_ms"], result["block_p99_ms"]) if v is not None]
    result["freshness_p99_ms"] = max(both) if both else None
    result["meets_1s_p99"] = bool(both) and max(both) <= 1000 and result["blocks_seen_ratio"] > 0.95
    # a read_committed reader of the tables cannot see a write before the worker's transaction
    # commits: judge the tables against 1 s plus one commit interval
    limit_ms = 1000 + 1000 * worker.commit_interval_s
    result["keeps_up"] = bool(both) and max(both) <= limit_ms and result["blocks_seen_ratio"] > 0.95
    return result


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


async def router_overhead(sup: Supervisor, requests: int) -> dict[str, Any]:
    router_port = free_port()
    engine = sup.spawn_node("bench-engine")
    sup.spawn("router", "router", "--port", str(router_port))
    router = f"http://127.0.0.1:{router_port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(240):
            try:
                async with http.get(router + "/ready") as r:
                    if (await r.json())["ready"]:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        direct: list[float] = []
        routed: list[float] = []
        for i in range(requests):
            order = [(engine, direct, "direct"), (router, routed, "routed")]
            if i % 2:
                order.reverse()
            for base, sink, tag in order:
                # distinct prompts: neither request may reuse the other's cached prefix
                body = {
                    "model": "llama-3.1-8b",
                    "prompt": f"{tag} request {i} " + "lorem ipsum " * 200,
                    "max_tokens": 8,
                    "stream": True,
                }
                t = time.perf_counter()
                async with http.post(base + "/v1/completions", json=body) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            sink.append(time.perf_counter() - t)
                            break
                    async for _ in r.content:
                        pass
    diff = [r - d for r, d in zip(routed, direct, strict=True)]
    return {
        "requests": requests,
        "direct_ttft_p50_ms": _ms(pct(direct, 0.5)),
        "direct_ttft_p99_ms": _ms(pct(direct, 0.99)),
        "router_ttft_p50_ms": _ms(pct(routed, 0.5)),
        "router_ttft_p99_ms": _ms(pct(routed, 0.99)),
        "overhead_ttft_p50_ms": _ms(pct(routed, 0.5) - pct(direct, 0.5)),  # type: ignore[operator]
        "overhead_ttft_p99_ms": _ms(pct(routed, 0.99) - pct(direct, 0.99)),  # type: ignore[operator]
        "paired_overhead_median_ms": _ms(statistics.median(diff)),
    }


class Env:
    """A fresh namespace, worker settings and process supervisor (one per measurement)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.kafka = KafkaSettings(
            bootstrap_servers=args.bootstrap,
            namespace=f"bench{uuid.uuid4().hex[:8]}",
            partitions=args.partitions,
        )
        tmp = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
        self.worker = WorkerSettings(
            web_port=free_port(), data_dir=str(tmp / "worker"), exactly_once=not args.at_least_once
        )
        self.sup = Supervisor(
            tmp / "logs",
            {
                "KVGATE_KAFKA__BOOTSTRAP_SERVERS": self.kafka.bootstrap_servers,
                "KVGATE_KAFKA__NAMESPACE": self.kafka.namespace,
                "KVGATE_KAFKA__PARTITIONS": str(args.partitions),
                "KVGATE_WORKER__WEB_PORT": str(self.worker.web_port),
                "KVGATE_WORKER__DATA_DIR": self.worker.data_dir,
                "KVGATE_WORKER__EXACTLY_ONCE": str(self.worker.exactly_once).lower(),
            },
        )


async def sweep(args: argparse.Namespace, mode: str, nodes: list[int]) -> list[dict[str, Any]]:
    """Freshness at growing node counts, until ``stop_after_failures`` steps miss 1 s p99.

    ``router``: what a router sees (tables, then the input); ``tables``: what the worker's tables
    hold (changelogs only)."""
    env = Env(args)
    await ensure_topics(env.kafka)
    steps: list[dict[str, Any]] = []
    replica = TableReplica(env.kafka, env.worker, f"bench-{mode}", follow_input=mode == "router")
    try:
        env.sup.spawn("worker", "worker")
        bus = KafkaBus(env.kafka, "bench-probe")
        await bus.start()
        await bus.send(HEARTBEATS, "probe", heartbeat("probe"))
        await bus.stop()
        await replica.start()
        for _ in range(600):
            if "probe" in replica.load:
                break
            await asyncio.sleep(0.1)
        failures = 0
        for n in nodes:
            step = await freshness_step(
                env.kafka, env.worker, env.sup, replica, n, args.duration, args
            )
            step["replica"] = mode
            steps.append(step)
            print(json.dumps(step), file=sys.stderr)
            ok = step["meets_1s_p99"] if mode == "router" else step["keeps_up"]
            failures = 0 if ok else failures + 1
            if failures >= args.stop_after_failures:
                break
            await asyncio.sleep(args.settle)
    finally:
        await replica.stop()
        env.sup.stop_all()
    return steps


async def main(args: argparse.Namespace) -> dict[str, Any]:
    sweeps: dict[str, list[dict[str, Any]]] = {"router": [], "tables": []}
    for mode in (m for m in args.modes if m in sweeps):
        sweeps[mode] = await sweep(args, mode, args.nodes if mode == "router" else args.table_nodes)
    env = Env(args)
    await ensure_topics(env.kafka)
    try:
        env.sup.spawn("worker", "worker")
        overhead = await router_overhead(env.sup, args.requests)
    finally:
        env.sup.stop_all()
    worker = env.worker
    steps = sweeps["router"]
    ok = [s for s in steps if s["meets_1s_p99"]]
    best = max(ok, key=lambda s: s["nodes"]) if ok else None
    return {
        "command": "python -m tests.benchmarks.pipeline " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "exactly_once": worker.exactly_once,
        "partitions": args.partitions,
        "kv_batch": {"interval_s": 0.1, "stored": args.stored, "removed": args.stored},
        "heartbeat_interval_s": 0.5,
        "max_nodes": best["nodes"] if best else 0,
        "freshness_p99_ms_at_max_nodes": best["freshness_p99_ms"] if best else None,
        "router_overhead_ttft_p50_ms": overhead["overhead_ttft_p50_ms"],
        "router_overhead_ttft_p99_ms": overhead["overhead_ttft_p99_ms"],
        "max_nodes_tables": _max_nodes(sweeps["tables"], "keeps_up"),
        "commit_interval_s": env.worker.commit_interval_s,
        "router_overhead": overhead,
        "steps": steps,
        "steps_tables": sweeps["tables"],
    }


def _max_nodes(steps: list[dict[str, Any]], key: str = "meets_1s_p99") -> int:
    return max((s["nodes"] for s in steps if s[key]), default=0)


def _step_table(
    steps: list[dict[str, Any]], key: str = "meets_1s_p99", title: str = "≤ 1 s p99"
) -> list[str]:
    lines = [
        "| nodes | offered msgs/s | block changes/s | hb p50 / p99 ms | block p50 / p99 ms "
        f"| blocks seen | worker CPU | replica CPU | {title} |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for s in steps:
        lines.append(
            f"| {s['nodes']} | {s['offered_msgs_per_s']} | "
            f"{s['offered_block_changes_per_s']:.0f} | "
            f"{s['heartbeat_p50_ms']} / {s['heartbeat_p99_ms']} | {s['block_p50_ms']} / "
            f"{s['block_p99_ms']} | {s['blocks_seen_ratio']:.0%} | "
            f"{s['worker_cpu_share']:.0%} | {s['replica_cpu_share']:.0%} | "
            f"{'yes' if s[key] else 'no'} |"
        )
    return lines


def write(result: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "pipeline.json").write_text(json.dumps(result, indent=2) + "\n")
    kv = result["kv_batch"]
    o = result["router_overhead"]
    lines = [
        "# Pipeline benchmark",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}; date {result['date']}; worker exactly_once="
        f"{result['exactly_once']}; {result['partitions']} partitions. Kafka, the Faust worker, "
        "the load generator and the measuring replica all share the machine's 2 cores.",
        "",
        "Load per simulated node: a heartbeat every "
        f"{result['heartbeat_interval_s']} s and a KV batch every {kv['interval_s']} s with "
        f"{kv['stored']} blocks stored and {kv['removed']} removed (80 block changes/s: about "
        "2.5 requests/s of 256 new prompt+output tokens each, at 16 tokens per block). "
        "Freshness = time from the message's production to its visibility in the replica, per "
        "heartbeat and per stored block; steps of "
        f"{result['steps'][0]['duration_s'] if result['steps'] else '?'} s, the first seconds "
        "left out.",
        "",
        f"**max_nodes = {result['max_nodes']}** — the largest node count whose heartbeats and "
        "KV blocks were visible in a router's replica within 1 s at p99 "
        f"(p99 there: {result['freshness_p99_ms_at_max_nodes']} ms). Target ≥ 1,000 nodes.",
        "",
        "## A router's replica (bootstrapped from the tables, then folding the input)",
        "",
        *_step_table(result["steps"]),
        "",
        "## The worker's tables alone (changelogs, read_committed)",
        "",
        f"max_nodes_tables = {result['max_nodes_tables']}: the largest node count the worker "
        "keeps up with, judged against 1 s plus one exactly-once commit interval "
        f"({result['commit_interval_s']} s), because a read_committed reader sees a table write "
        "only when the worker's transaction commits (the freshness-vs-exactly-once trade-off).",
        "",
        *_step_table(result["steps_tables"], "keeps_up", "keeps up"),
        "",
        "What limits it: the Faust worker writes one changelog record per block change and one "
        "per heartbeat, and one worker process saturates one core at a few thousand table writes "
        "per second; beyond that its backlog grows, and with it the tables' staleness. Routers do "
        "not wait for the tables (they fold the input themselves), but on this machine the "
        "saturated worker and the broker compete with them for the same two cores, which is what "
        "bends the router curve near 1,000 nodes. Scale-out is more partitions and more workers "
        "on other cores or machines.",
        "",
        "## Router overhead (TTFT through the router minus TTFT direct to the engine)",
        "",
        f"{o['requests']} sequential streamed requests (~600 prompt tokens, distinct per "
        "request so that no prefix is cached; 8 output tokens), "
        "alternating direct and routed, one simulated engine.",
        "",
        "| | p50 ms | p99 ms |",
        "|---|---:|---:|",
        f"| direct | {o['direct_ttft_p50_ms']} | {o['direct_ttft_p99_ms']} |",
        f"| through router | {o['router_ttft_p50_ms']} | {o['router_ttft_p99_ms']} |",
        f"| overhead | {o['overhead_ttft_p50_ms']} | {o['overhead_ttft_p99_ms']} |",
        "",
        f"Median of paired differences: {o['paired_overhead_median_ms']} ms.",
        "",
    ]
    (OUT / "pipeline.md").write_text("\n".join(lines))


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bootstrap", default=os.environ.get("KVGATE_TEST_KAFKA", "127.0.0.1:19092"))
    p.add_argument(
        "--nodes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[50, 100, 200, 400, 700, 1000],
    )
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--drain-limit", type=float, default=60.0)
    p.add_argument("--stored", type=int, default=4)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--at-least-once", action="store_true")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["router", "tables"])
    p.add_argument(
        "--table-nodes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[10, 25, 50, 100, 200],
    )
    p.add_argument("--stop-after-failures", type=int, default=1)
    p.add_argument("--settle", type=float, default=3.0, help="pause between steps")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    result = asyncio.run(main(args))
    if not args.no_write:
        write(result)
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=2))


if __name__ == "__main__":
    cli()
