"""``kvgate demo``: the whole pipeline on this machine, a workload through it, a SQL summary.

Brings up Kafka and Redis (the repo's launchers; only if not already running), N simulated engines
with their agents, a Faust worker and a router as child processes, and the ClickHouse sink in this
process (chDB lets one process own its data path, so the process that sinks also answers the
summary queries). Drives a shared-system-prompt chat workload through the router, waits until
every decision and outcome is in ClickHouse, prints the summary, and tears down what it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from analytics.clickhouse import open_clickhouse
from analytics.schema import migrate
from analytics.sink import Sink
from analytics.summary import run_summary
from analytics.workloads import shared_prompt_chat
from deploy.procs import LocalInfra, Supervisor, free_port
from deploy.settings import Settings
from streams.home import home
from streams.kafka import KafkaBus, ensure_topics

__all__ = ["DemoOptions", "run_demo"]


@dataclass(frozen=True)
class DemoOptions:
    duration_s: float = 30.0
    rps: float = 4.0
    engines: int = 4
    num_gpu_blocks: int | None = None
    json_output: bool = False
    start_infra: bool = True


async def _wait_ready(url: str, engines: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(url + "/ready") as r:
                    last = await r.json()
                    if last.get("ready") and last.get("healthy_nodes", 0) >= engines:
                        return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"router not ready after {timeout_s:.0f} s: {last}")


async def _one(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> bool:
    try:
        async with http.post(
            url + "/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        ) as r:
            async for _ in r.content:
                pass
            return r.status == 200
    except (aiohttp.ClientError, OSError):
        return False


async def _drive(url: str, opts: DemoOptions, model: str, console: Console) -> tuple[int, int]:
    specs = list(shared_prompt_chat(model, opts.rps, opts.duration_s))
    ok = failed = 0
    progress = Progress(
        TextColumn("[bold]workload"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        disable=opts.json_output,
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        with progress:
            task = progress.add_task("requests", total=len(specs))
            start = time.monotonic()
            pending: set[asyncio.Task[bool]] = set()

            def done(t: asyncio.Task[bool]) -> None:
                nonlocal ok, failed
                pending.discard(t)
                if not t.cancelled() and t.result():
                    ok += 1
                else:
                    failed += 1
                progress.advance(task)

            for spec in specs:
                delay = spec.arrival_s - (time.monotonic() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                t = asyncio.create_task(_one(http, url, spec.body))
                pending.add(t)
                t.add_done_callback(done)
            if pending:
                await asyncio.wait(pending)
    return ok, failed


async def _run(
    settings: Settings, opts: DemoOptions, console: Console, log_dir: Path
) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    kafka = settings.kafka.model_copy(
        update={"namespace": f"{settings.kafka.namespace}-demo-{run}"}
    )
    router_id = f"demo-{run}"
    router_port = free_port()
    env = {
        "KVGATE_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "KVGATE_KAFKA__NAMESPACE": kafka.namespace,
        "KVGATE_WORKER__WEB_PORT": str(free_port()),
        "KVGATE_WORKER__DATA_DIR": str(log_dir / "worker-data"),
        "KVGATE_ROUTER__ROUTER_ID": router_id,
    }
    sup = Supervisor(log_dir, env)
    ch = open_clickhouse(settings.clickhouse)
    db = settings.clickhouse.database
    migrate(ch, db)
    bus = KafkaBus(kafka, "kvgate-demo")
    stop_sink = asyncio.Event()
    sink_task: asyncio.Task[None] | None = None
    try:
        await ensure_topics(kafka)
        await bus.start()
        sink = Sink(
            kafka, settings.sink.model_copy(update={"group_id": f"sink-{run}"}), ch, db, bus
        )
        sink_task = asyncio.create_task(sink.run(stop_sink))
        model = settings.engine.served_model_name
        for i in range(opts.engines):
            sup.spawn_node(f"node-{i}", opts.num_gpu_blocks)
        sup.spawn("worker", "worker")
        sup.spawn("router", "router", "--port", str(router_port))
        url = f"http://127.0.0.1:{router_port}"
        if not opts.json_output:
            console.print(
                f"[bold]kvgate demo[/] run {run}: {opts.engines} engines, worker, router "
                f"on {url}; logs in {log_dir}"
            )
        await _wait_ready(url, opts.engines, 120)
        started = time.time()
        ok, failed = await _drive(url, opts, model, console)
        wall = time.time() - started
        # every decision and outcome must be in ClickHouse before the summary
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sink.inserted["outcomes"] >= ok + failed and await sink.lag() == 0:
                break
            await asyncio.sleep(0.2)
        summary = run_summary(ch, db, router_id)
        summary.update(
            {
                "run": run,
                "router_id": router_id,
                "duration_s": round(wall, 2),
                "client_ok": ok,
                "client_failed": failed,
                "engines": opts.engines,
                "throughput_rps": round(summary["requests"] / wall, 2) if wall else 0.0,
            }
        )
        return summary
    finally:
        try:
            stop_sink.set()
            if sink_task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sink_task, 10)
        finally:  # the children stop even when the wait is cancelled (a second signal)
            sup.stop_all()
            try:
                await bus.stop()
            finally:
                ch.close()


def render(summary: dict[str, Any], console: Console) -> None:
    t = Table(title=f"kvgate demo {summary['run']}: summary from ClickHouse", show_header=False)
    fmt = {
        "hit_rate": "{:.1%}",
        "ttft_p50_s": "{:.3f} s",
        "ttft_p99_s": "{:.3f} s",
        "tpot_p50_s": "{:.4f} s",
        "tpot_p99_s": "{:.4f} s",
        "decision_p50_us": "{:.0f} µs",
        "decision_p99_us": "{:.0f} µs",
    }
    for key in (
        "requests",
        "errors",
        "hit_rate",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
        "decision_rows",
        "outcome_rows",
        "decision_p50_us",
        "decision_p99_us",
        "throughput_rps",
        "duration_s",
    ):
        v = summary.get(key)
        t.add_row(key, "—" if v is None else fmt.get(key, "{}").format(v))
    console.print(t)
    nodes = Table(title="per-node share")
    for col in ("node", "requests", "share", "hit rate"):
        nodes.add_column(col)
    for node, row in summary["per_node"].items():
        nodes.add_row(node, str(row["requests"]), f"{row['share']:.1%}", f"{row['hit_rate']:.1%}")
    console.print(nodes)
    console.print(
        "decisions by reason: " + ", ".join(f"{k}={v}" for k, v in summary["reasons"].items())
    )
    console.print(
        f"try other settings on this run: kvgate replay --from-clickhouse --router-id "
        f"{summary['router_id']} --since -1h --config candidate.yaml --html report.html"
    )


def run_demo(settings: Settings, opts: DemoOptions) -> dict[str, Any]:
    console = Console(stderr=opts.json_output)
    infra = LocalInfra.from_settings(settings.kafka.bootstrap_servers, settings.redis.url)
    log_dir = home() / "demo" / time.strftime("%Y%m%d-%H%M%S")
    try:
        if opts.start_infra:
            if not opts.json_output:
                console.print("starting Kafka (KRaft) and Redis …")
            infra.up("kafka")
            infra.up("redis")
        summary = asyncio.run(_run(settings, opts, console, log_dir))
    finally:
        infra.down()
    if opts.json_output:
        print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    else:
        render(summary, console)
    return summary
