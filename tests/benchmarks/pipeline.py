"""Pipeline benchmark: how many simulated nodes the pipeline carries with events visible in a
router replica within 1 s (p99), and the router's TTFT overhead.

    python -m tests.benchmarks.pipeline [--nodes 50,100,200,400,700,1000] [--duration 20]

Needs Kafka (``deploy/kafka/kafka.sh start``). Writes ``docs/benchmarks/pipeline.json`` and
``docs/benchmarks/pipeline.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from deploy.procs import Supervisor, free_port
from streams.exceptions import StreamError
from streams.kafka import KafkaBus, delete_namespace_topics, ensure_topics
from streams.replica import TableReplica
from streams.schemas import Heartbeat
from streams.settings import KafkaSettings, WorkerSettings
from streams.topics import HEARTBEATS
from tests.benchmarks.loadgen import produced_ms
from tests.benchmarks.pipeline_report import OUT, write
from tests.factories import heartbeat


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
    workers = {name: proc.pid for name, proc in sup.procs.items() if name.startswith("worker")}
    cpu0 = {name: cpu_s(pid) for name, pid in workers.items()}
    self0, t0 = time.process_time(), time.monotonic()
    gen_stats = await loadgen(kafka, prefix, nodes, duration, args)
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
    shares = {name: (cpu_s(pid) - cpu0[name]) / wall for name, pid in workers.items()}
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
        "block_p90_ms": _ms(pct(kv_lat, 0.9)),
        "block_p99_ms": _ms(pct(kv_lat, 0.99)),
        "blocks_seen_ratio": round(
            len(kv_lat) / max(1, produced_blocks * (1 - args.warmup / duration)), 3
        ),
        "drain_s": round(time.monotonic() - drain_start, 1),
        "worker_cpu_share": round(sum(shares.values()), 3),
        # three decimals: the scale-out ratio divides two of these (~0.2 each at 500 nodes),
        # and two-decimal rounding alone moved it by up to a tenth
        "worker_cpu_shares": {n: round(v, 3) for n, v in shares.items()},
        "replica_cpu_share": round((time.process_time() - self0) / wall, 2),
    }
    both = [v for v in (result["heartbeat_p99_ms"], result["block_p99_ms"]) if v is not None]
    result["freshness_p99_ms"] = max(both) if both else None
    changes_k = result["offered_block_changes_per_s"] / 1000
    result["worker_cpu_s_per_1000_changes"] = round(result["worker_cpu_share"] / changes_k, 4)
    result["meets_1s_p99"] = bool(both) and max(both) <= 1000 and result["blocks_seen_ratio"] > 0.95
    # a read_committed reader of the tables cannot see a write before the worker's transaction
    # commits: judge the tables against 1 s plus one commit interval
    limit_ms = 1000 + 1000 * worker.commit_interval_s
    result["keeps_up"] = bool(both) and max(both) <= limit_ms and result["blocks_seen_ratio"] > 0.95
    return result


async def loadgen(
    kafka: KafkaSettings, prefix: str, nodes: int, duration: float, args: argparse.Namespace
) -> dict[str, Any]:
    """Run the simulated nodes (tests/benchmarks/loadgen.py) to the end; its figures."""
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
    stats: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return stats


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
        self.tmp = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
        self.worker = WorkerSettings(
            web_port=free_port(),
            data_dir=str(self.tmp / "worker"),
            exactly_once=not args.at_least_once,
            commit_interval_s=args.commit_interval,
        )
        self.sup = Supervisor(
            self.tmp / "logs",
            {
                "KVGATE_KAFKA__BOOTSTRAP_SERVERS": self.kafka.bootstrap_servers,
                "KVGATE_KAFKA__NAMESPACE": self.kafka.namespace,
                "KVGATE_KAFKA__PARTITIONS": str(args.partitions),
                "KVGATE_WORKER__WEB_PORT": str(self.worker.web_port),
                "KVGATE_WORKER__DATA_DIR": self.worker.data_dir,
                "KVGATE_WORKER__EXACTLY_ONCE": str(self.worker.exactly_once).lower(),
                "KVGATE_WORKER__COMMIT_INTERVAL_S": str(self.worker.commit_interval_s),
            },
        )

    def spawn_workers(self, count: int = 1, source: Path | None = None) -> list[str]:
        """``count`` workers of one consumer group (the first on the settings' port), run from
        the source tree ``source`` (another revision of kvgate) if given."""
        names = []
        for i in range(count):
            name = "worker" if i == 0 else f"worker{i + 1}"
            env = (
                {}
                if i == 0
                else {
                    "KVGATE_WORKER__WEB_PORT": str(free_port()),
                    "KVGATE_WORKER__DATA_DIR": str(self.tmp / name),
                }
            )
            argv = [sys.executable, "-m", "deploy", "worker"]
            self.sup.spawn_argv(name, argv, env=env, cwd=source)
            names.append(name)
        return names

    async def close(self) -> None:
        """Stop the processes and delete the namespace's topics (a broker that keeps every
        run's partitions slows the runs after it)."""
        self.sup.stop_all()
        try:
            await delete_namespace_topics(self.kafka)
        except StreamError as exc:  # never hide why a measurement ended
            print(f"topics of {self.kafka.namespace} left behind: {exc}", file=sys.stderr)


async def settle(env: Env, replica: TableReplica, timeout_s: float = 180.0) -> None:
    """Wait until the workers fold every partition: probe heartbeats keyed to land on all of
    them are in the tables (a rebalance between workers that start together also settles)."""
    bus = KafkaBus(env.kafka, "bench-probe")
    await bus.start()
    try:
        probes = [f"probe{i}" for i in range(4 * env.kafka.partitions)]
        deadline = time.monotonic() + timeout_s
        seq = 0
        while time.monotonic() < deadline:
            seq += 1
            for p in probes:
                # fields left at their default are left out: a baseline revision's worker (which
                # may predate them) folds the probes too
                value = heartbeat(p, seq=seq).model_dump_json(exclude_defaults=True).encode()
                await bus.publish_raw(bus.topic(HEARTBEATS), p.encode(), value)
            await bus.flush()
            await asyncio.sleep(2.0)
            if all(p in replica.load and replica.load[p].seq >= seq for p in probes):
                return
        raise RuntimeError("the workers did not fold every partition in time")
    finally:
        await bus.stop()


def source_tree(rev: str) -> Path:
    """kvgate's source at git revision ``rev``, unpacked in a temporary directory."""
    repo = Path(__file__).resolve().parents[2]
    out = Path(tempfile.mkdtemp(prefix=f"kvgate-{rev[:12]}-"))
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", rev],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


async def sweep(
    args: argparse.Namespace,
    mode: str,
    nodes: list[int],
    workers: int = 1,
    source: Path | None = None,
) -> list[dict[str, Any]]:
    """Freshness at growing node counts, until ``stop_after_failures`` steps miss 1 s p99.

    ``router``: what a router sees (tables, then the input); ``tables``: what the worker's tables
    hold (changelogs only). ``workers`` workers share the input's partitions."""
    env = Env(args)
    await ensure_topics(env.kafka)
    steps: list[dict[str, Any]] = []
    replica = TableReplica(env.kafka, env.worker, f"bench-{mode}", follow_input=mode == "router")
    try:
        env.spawn_workers(workers, source)
        await replica.start()
        await settle(env, replica)
        failures = 0
        for n in nodes:
            step = await freshness_step(
                env.kafka, env.worker, env.sup, replica, n, args.duration, args
            )
            step["replica"] = mode
            step["workers"] = workers
            steps.append(step)
            print(json.dumps(step), file=sys.stderr)
            ok = step["meets_1s_p99"] if mode == "router" else step["keeps_up"]
            failures = 0 if ok else failures + 1
            if failures >= args.stop_after_failures:
                break
            await asyncio.sleep(args.settle)
    finally:
        await replica.stop()
        await env.close()
    return steps


async def worker_cost(args: argparse.Namespace, source: Path | None) -> dict[str, Any]:
    """The worker's CPU seconds per 1,000 block changes at ``--cost-nodes`` nodes, for the
    current tree or the source tree of another revision (its tables need not be readable by
    this revision: only the heartbeats' load table, whose format has not changed, is used to
    see that the worker runs)."""
    env = Env(args)
    await ensure_topics(env.kafka)
    replica = TableReplica(env.kafka, env.worker, "bench-cost", follow_input=False)
    replica.changelog_topics = (replica.load_topic,)  # another revision's index may differ
    try:
        (name,) = env.spawn_workers(1, source)
        await replica.start()
        await settle(env, replica)
        pid = env.sup.procs[name].pid
        cpu0, t0 = cpu_s(pid), time.monotonic()
        stats = await loadgen(env.kafka, "c-", args.cost_nodes, args.duration, args)
        await asyncio.sleep(args.cost_drain)  # what is still queued is folded (and paid for)
        cpu = cpu_s(pid) - cpu0
        wall = time.monotonic() - t0
    finally:
        await replica.stop()
        await env.close()
    changes = args.cost_nodes * args.stored * 2 / 0.1 * args.duration
    return {
        "nodes": args.cost_nodes,
        "offered_msgs_per_s": round(stats["msgs_per_s"], 1),
        "block_changes": int(changes),
        "worker_cpu_s": round(cpu, 2),
        "worker_cpu_share": round(cpu / wall, 2),
        "worker_cpu_s_per_1000_changes": round(cpu / (changes / 1000), 5),
    }


async def guarantees(args: argparse.Namespace) -> dict[str, Any]:
    """The worker in each processing guarantee, one after the other on fresh namespaces: its
    tables' freshness at ``--guarantee-nodes`` nodes (what a read_committed reader of the
    changelogs sees: exactly-once shows table writes only at each commit) and its CPU per 1,000
    block changes at ``--cost-nodes`` nodes."""
    out: dict[str, Any] = {}
    for name, at_least_once in (("exactly_once", False), ("at_least_once", True)):
        mode_args = argparse.Namespace(**{**vars(args), "at_least_once": at_least_once})
        (step,) = await sweep(mode_args, "tables", [args.guarantee_nodes])
        cost = await worker_cost(mode_args, None)
        out[name] = {
            "nodes": args.guarantee_nodes,
            "block_p50_ms": step["block_p50_ms"],
            "block_p99_ms": step["block_p99_ms"],
            "heartbeat_p99_ms": step["heartbeat_p99_ms"],
            "keeps_up": step["keeps_up"],
            "worker_cpu_share": step["worker_cpu_share"],
            "worker_cpu_s_per_1000_changes": cost["worker_cpu_s_per_1000_changes"],
        }
    out["command"] = "python -m tests.benchmarks.pipeline " + " ".join(sys.argv[1:])
    out["date"] = time.strftime("%Y-%m-%d")
    return out


async def wait_ready(url: str, timeout_s: float) -> float:
    """Seconds until ``url`` answers 200 (``timeout_s`` when it never does)."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() - t0 < timeout_s:
            try:
                async with http.get(url) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
    return timeout_s


async def router_restart(args: argparse.Namespace) -> dict[str, Any]:
    """A router killed (-9) while ``--restart-nodes`` nodes publish, started again: seconds
    until its ``/ready`` says it bootstrapped from the tables and caught up with the input.
    Admission is off for this router: readiness then depends on the tables alone."""
    env = Env(args)
    await ensure_topics(env.kafka)
    replica = TableReplica(env.kafka, env.worker, "bench-restart", follow_input=False)
    port = free_port()
    router_env = {"KVGATE_ADMISSION__ENABLED": "false"}
    argv = [sys.executable, "-m", "deploy", "router", "--port", str(port)]
    url = f"http://127.0.0.1:{port}/ready"
    try:
        env.spawn_workers(1)
        await replica.start()
        await settle(env, replica)
        await replica.stop()
        total = args.restart_warmup + 2 * args.restart_limit + 10
        gen = asyncio.create_task(loadgen(env.kafka, "r-", args.restart_nodes, total, args))
        await asyncio.sleep(args.restart_warmup)
        env.sup.spawn_argv("router", argv, env=router_env)
        first = await wait_ready(url, args.restart_limit)
        await asyncio.sleep(3.0)
        env.sup.kill("router", signal.SIGKILL)
        env.sup.spawn_argv("router", argv, env=router_env)
        again = await wait_ready(url, args.restart_limit)
        async with aiohttp.ClientSession() as http, http.get(url) as r:
            ready = await r.json()
        gen.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gen
    finally:
        await env.close()
    return {
        "nodes": args.restart_nodes,
        "first_start_ready_s": round(first, 2),
        "restart_ready_s": round(again, 2),
        "indexed_blocks": ready.get("indexed_blocks"),
        "healthy_nodes": ready.get("healthy_nodes"),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    sweeps: dict[str, list[dict[str, Any]]] = {"router": [], "tables": []}
    for mode in (m for m in args.modes if m in sweeps):
        sweeps[mode] = await sweep(args, mode, args.nodes if mode == "router" else args.table_nodes)
    out: dict[str, Any] = {}
    if "cost" in args.modes:
        current = await worker_cost(args, None)
        baseline = None
        if args.baseline_rev:
            tree = source_tree(args.baseline_rev)
            try:
                baseline = await worker_cost(args, tree)
            finally:
                shutil.rmtree(tree, ignore_errors=True)
        out["worker_cost"] = {
            "baseline_rev": args.baseline_rev,
            "current": current,
            "baseline": baseline,
            "reduction": round(
                baseline["worker_cpu_s_per_1000_changes"]
                / current["worker_cpu_s_per_1000_changes"],
                1,
            )
            if baseline
            else None,
        }
    if "scaleout" in args.modes:
        one = await sweep(args, "tables", [args.scaleout_nodes], workers=1)
        two = await sweep(args, "tables", [args.scaleout_nodes], workers=2)
        busiest = max(two[0]["worker_cpu_shares"].values())
        out["scaleout"] = {
            "nodes": args.scaleout_nodes,
            "partitions": args.partitions,
            "one_worker": one[0],
            "two_workers": two[0],
            # capacity = load carried per CPU second of the busiest worker (each worker gets its
            # own core in a deployment; here they share two with the broker)
            "ratio": round(one[0]["worker_cpu_share"] / busiest, 2),
        }
    if "restart" in args.modes:
        out["restart"] = await router_restart(args)
    if "guarantees" in args.modes:
        out["guarantees"] = await guarantees(args)
    overhead: dict[str, Any] = {}
    env = Env(args)
    if "overhead" in args.modes:
        await ensure_topics(env.kafka)
        try:
            env.spawn_workers(1)
            overhead = await router_overhead(env.sup, args.requests)
        finally:
            await env.close()
    steps = sweeps["router"]
    ok = [s for s in steps if s["meets_1s_p99"]]
    best = max(ok, key=lambda s: s["nodes"]) if ok else None
    cost = out.get("worker_cost") or {}
    return {
        "command": "python -m tests.benchmarks.pipeline " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "exactly_once": env.worker.exactly_once,
        "partitions": args.partitions,
        "kv_batch": {"interval_s": 0.1, "stored": args.stored, "removed": args.stored},
        "heartbeat_interval_s": 0.5,
        "max_nodes": best["nodes"] if best else 0,
        "freshness_p99_ms_at_max_nodes": best["freshness_p99_ms"] if best else None,
        "router_overhead_ttft_p50_ms": overhead.get("overhead_ttft_p50_ms"),
        "router_overhead_ttft_p99_ms": overhead.get("overhead_ttft_p99_ms"),
        "max_nodes_tables": _max_nodes(sweeps["tables"], "keeps_up"),
        "router_restart_ready_s_at_1000": (out.get("restart") or {}).get("restart_ready_s"),
        "worker_scaleout_ratio": (out.get("scaleout") or {}).get("ratio"),
        "worker_cpu_reduction_per_1000_changes": cost.get("reduction"),
        "commit_interval_s": env.worker.commit_interval_s,
        "router_overhead": overhead,
        **out,
        "steps": steps,
        "steps_tables": sweeps["tables"],
    }


def _max_nodes(steps: list[dict[str, Any]], key: str = "meets_1s_p99") -> int:
    return max((s["nodes"] for s in steps if s[key]), default=0)


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
    p.add_argument(
        "--commit-interval", type=float, default=1.0, help="the worker's commit interval, s"
    )
    p.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=["router", "tables", "cost", "scaleout", "restart", "overhead", "guarantees"],
        help="what to measure; 'guarantees' alone adds its section to the existing report",
    )
    p.add_argument(
        "--guarantee-nodes", type=int, default=500, help="load of the guarantees comparison"
    )
    p.add_argument("--cost-nodes", type=int, default=50, help="load of the CPU-cost comparison")
    p.add_argument("--cost-drain", type=float, default=5.0)
    p.add_argument(
        "--baseline-rev",
        default=None,
        help="git revision whose worker is measured beside this one (CPU per block change)",
    )
    p.add_argument("--scaleout-nodes", type=int, default=500)
    p.add_argument("--restart-nodes", type=int, default=1000)
    p.add_argument("--restart-warmup", type=float, default=20.0)
    p.add_argument("--restart-limit", type=float, default=60.0)
    p.add_argument(
        "--table-nodes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[250, 500, 750, 1000, 1250],
    )
    p.add_argument("--stop-after-failures", type=int, default=1)
    p.add_argument("--settle", type=float, default=3.0, help="pause between steps")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.modes == ["guarantees"]:  # one section, measured alone, into the existing report
        result = json.loads((OUT / "pipeline.json").read_text())
        result["guarantees"] = asyncio.run(guarantees(args))
    else:
        result = asyncio.run(main(args))
    if not args.no_write:
        write(result)
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=2))


if __name__ == "__main__":
    cli()
