"""The ``kvgate`` command: one subcommand per component, plus the demo and tooling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from deploy.failures import explain
from deploy.logs import configure
from deploy.settings import Settings, load_settings, public_dump
from streams.home import home

if TYPE_CHECKING:
    from analytics.recorded import Recorded
    from analytics.sim.traces import Trace

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML settings file (or $KVGATE_CONFIG)")
]


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"kvgate {version('kvgate')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("kvgate (not installed)")
        raise typer.Exit


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
    log_level: Annotated[
        str | None,
        typer.Option(
            "--log-level",
            help="DEBUG, INFO, WARNING or ERROR (default: INFO; the worker's Faust: WARNING)",
        ),
    ] = None,
    log_format: Annotated[
        str, typer.Option("--log-format", help="text, or json: one JSON object per line")
    ] = "text",
) -> None:
    """kvgate: KV-cache-aware routing and admission control for LLM inference clusters."""
    if log_level is not None:
        if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise typer.BadParameter(f"unknown log level {log_level!r}", param_hint="--log-level")
        _LOG["level"] = log_level.upper()
    if log_format not in ("text", "json"):
        raise typer.BadParameter("text or json", param_hint="--log-format")
    _LOG["format"] = log_format


def _settings(config: Path | None) -> Settings:
    try:
        return load_settings(config)
    except Exception as exc:
        raise typer.BadParameter(str(exc)) from exc


_LOG: dict[str, str] = {}  # --log-level / --log-format, from the root options


def _logging(level: str = "INFO") -> None:
    """The process's logging: ``level`` unless ``--log-level`` was given."""
    configure(_LOG.get("level", level), "json" if _LOG.get("format") == "json" else "text")


@app.command()
def engine(
    config: ConfigOpt = None,
    port: Annotated[int | None, typer.Option(help="HTTP port")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on")] = None,
    kv_events_port: Annotated[int | None, typer.Option(help="ZMQ PUB port for KV events")] = None,
    kv_events_replay_port: Annotated[
        int | None, typer.Option(help="ZMQ ROUTER port answering replay requests")
    ] = None,
    num_gpu_blocks: Annotated[int | None, typer.Option(help="override the KV capacity")] = None,
    sglang: Annotated[
        bool,
        typer.Option("--sglang", help="look like SGLang: its /metrics names, no KV events"),
    ] = False,
    kv_events_connect: Annotated[
        bool,
        typer.Option(
            "--kv-events-connect", help="dial out to the KV-event port (a collector binds it)"
        ),
    ] = False,
    data_parallel_size: Annotated[
        int | None, typer.Option(help="engine cores (data-parallel ranks), each its own cache")
    ] = None,
    lora_modules: Annotated[
        list[str] | None,
        typer.Option("--lora-modules", help="a LoRA adapter it serves: name=path (repeatable)"),
    ] = None,
) -> None:
    """Run one simulated inference engine (vLLM-compatible HTTP, metrics and KV events)."""
    from aiohttp import web

    from agents.simengine import SimEngine

    s = _settings(config).engine
    updates: dict[str, object] = {}
    if port is not None:
        updates["port"] = port
    if host is not None:
        updates["host"] = host
    if kv_events_port is not None:
        updates["kv_events_endpoint"] = f"tcp://127.0.0.1:{kv_events_port}"
    if kv_events_replay_port is not None:
        updates["kv_events_replay_endpoint"] = f"tcp://127.0.0.1:{kv_events_replay_port}"
    if num_gpu_blocks is not None:
        updates["profile"] = s.profile.model_copy(
            update={"num_gpu_blocks_override": num_gpu_blocks}
        )
    if sglang:
        updates.update(metrics_format="sglang", kv_events_endpoint=None)
    if kv_events_connect:
        updates["kv_events_connect"] = True
    if data_parallel_size is not None:
        updates["data_parallel_size"] = data_parallel_size
    s = s.model_copy(update=updates)
    if lora_modules:
        try:
            s = type(s).model_validate({**s.model_dump(), "lora_modules": lora_modules})
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    _logging()
    web.run_app(SimEngine(s).app(), host=s.host, port=s.port, print=None, access_log=None)


@app.command()
def agent(
    config: ConfigOpt = None,
    node_id: Annotated[str | None, typer.Option(help="node id")] = None,
    engine_url: Annotated[str | None, typer.Option(help="engine base URL")] = None,
    advertise_url: Annotated[
        str | None,
        typer.Option(help="the engine's URL for routers, when not --engine-url (a sidecar's)"),
    ] = None,
    kv_events: Annotated[str | None, typer.Option(help="engine KV-event ZMQ endpoint")] = None,
    kv_events_replay: Annotated[
        str | None, typer.Option(help="engine KV-event replay endpoint (fills sequence gaps)")
    ] = None,
    engine_kind: Annotated[str | None, typer.Option(help="vllm or sglang")] = None,
    no_kv_events: Annotated[
        bool,
        typer.Option(
            "--no-kv-events",
            help="the engine publishes no KV events: routers infer its cache (approximate)",
        ),
    ] = False,
    kv_events_bind: Annotated[
        bool,
        typer.Option(
            "--kv-events-bind",
            help="bind the KV-event endpoint; the engine dials in (collector style, as in llm-d)",
        ),
    ] = False,
    data_parallel_size: Annotated[
        int | None,
        typer.Option(help="the engine's data-parallel ranks: one node each (<node-id>-dp<rank>)"),
    ] = None,
) -> None:
    """Run the node agent (sidecar) for one engine."""
    from agents.agent import NodeAgent
    from streams.kafka import KafkaBus, ensure_topics

    s = _settings(config)
    updates: dict[str, str | None] = {
        k: v
        for k, v in {
            "node_id": node_id,
            "engine_url": engine_url,
            "advertise_url": advertise_url,
            "kv_events_endpoint": kv_events,
            "kv_events_replay_endpoint": kv_events_replay,
            "engine_kind": engine_kind,
        }.items()
        if v is not None
    }
    if no_kv_events:
        updates["kv_events_endpoint"] = None
    a = s.agent.model_copy(
        update={**updates, **({"kv_events_bind": True} if kv_events_bind else {})}
    )
    _logging()

    if data_parallel_size is not None:
        a = a.model_copy(update={"data_parallel_size": data_parallel_size})

    async def main() -> None:
        await ensure_topics(s.kafka)
        bus = KafkaBus(s.kafka, f"agent-{a.node_id}")
        await bus.start()
        agents = [NodeAgent(rank, bus) for rank in a.ranks()]  # one per data-parallel rank
        runner = None
        if a.metrics_port is not None:
            from agents.metrics import agent_registry
            from streams.metrics_http import serve_metrics

            runner, _ = await serve_metrics(a.metrics_host, a.metrics_port, agent_registry(agents))
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        running = asyncio.gather(*(agent.run() for agent in agents))
        stop: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({running, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stopping.is_set() and a.drain_on_stop_s > 0 and not running.done():
                # a scale-down: the routers drain the node before it goes
                logging.getLogger("agents").info("stopping: draining for %.0f s", a.drain_on_stop_s)
                for agent in agents:
                    agent.draining = True
                await asyncio.wait([running], timeout=a.drain_on_stop_s)
        finally:
            stop.cancel()
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            if runner is not None:
                await runner.cleanup()
            await bus.stop()

    asyncio.run(main())


@app.command()
def worker(config: ConfigOpt = None) -> None:
    """Run the Faust worker that materializes the load table and the prefix index."""
    import gc

    from faust import Worker

    from streams.app import build_app
    from streams.kafka import ensure_topics

    s = _settings(config)
    _logging()
    asyncio.run(ensure_topics(s.kafka))
    gc.set_threshold(s.worker.gc_young_threshold, 10, 10)
    faust_app = build_app(s.kafka, s.worker)
    Worker(faust_app, loglevel="WARNING").execute_from_commandline()


@app.command()
def topics(config: ConfigOpt = None) -> None:
    """Create kvgate's topics (idempotent)."""
    from streams.kafka import ensure_topics
    from streams.topics import ALL_TOPICS

    s = _settings(config)
    asyncio.run(ensure_topics(s.kafka))
    for spec in ALL_TOPICS:
        typer.echo(spec.name(s.kafka.namespace))


@app.command()
def schemas(
    out: Annotated[Path, typer.Option(help="output folder")] = Path("docs/topics"),
) -> None:
    """Write the JSON Schema of every topic's value model."""
    from streams.jsonschema import write_schemas

    for path in write_schemas(out):
        typer.echo(str(path))


@app.command("settings")
def show_settings(config: ConfigOpt = None) -> None:
    """Print the effective settings (secrets masked)."""
    typer.echo(json.dumps(public_dump(_settings(config)), indent=2))


@app.command()
def router(
    config: ConfigOpt = None,
    port: Annotated[int | None, typer.Option(help="HTTP port")] = None,
    host: Annotated[
        str | None, typer.Option(help="address to listen on (default loopback; 0.0.0.0 in pods)")
    ] = None,
    epp_port: Annotated[
        int | None,
        typer.Option(help="also serve the endpoint picker (Envoy ext_proc gRPC) on this port"),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(help="router processes sharing the port (SO_REUSEPORT)", min=1, max=64),
    ] = None,
) -> None:
    """Run a stateless router (OpenAI-compatible proxy) with replicas of the tables."""
    from deploy.routerproc import run_router

    s = _settings(config)
    options = {"port": port, "host": host, "epp_port": epp_port, "workers": workers}
    given = {k: v for k, v in options.items() if v is not None}
    if given:
        s = s.model_copy(update={"router": s.router.model_copy(update=given)})
    _logging()
    run_router(s)


@app.command()
def demo(
    config: ConfigOpt = None,
    duration: Annotated[float, typer.Option(help="workload seconds")] = 30.0,
    rps: Annotated[float, typer.Option(help="requests per second")] = 4.0,
    engines: Annotated[int, typer.Option(min=1, max=64, help="simulated engines")] = 4,
    num_gpu_blocks: Annotated[int | None, typer.Option(help="KV blocks per engine")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
    no_infra: Annotated[bool, typer.Option(help="use already running Kafka and Redis")] = False,
) -> None:
    """Run the whole pipeline locally, drive a workload through it, summarize from ClickHouse."""
    from deploy.demo import DemoOptions, run_demo

    _logging("WARNING")
    # a fresh broker answers "coordinator not available" for a moment; the clients retry
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    run_demo(
        _settings(config),
        DemoOptions(duration, rps, engines, num_gpu_blocks, json_output, not no_infra),
    )


@app.command()
def sink(config: ConfigOpt = None) -> None:
    """Run the Kafka → ClickHouse sink (this process owns the chDB data path)."""
    from analytics.clickhouse import open_clickhouse
    from analytics.schema import apply_identity_retention, migrate
    from analytics.sink import Sink
    from streams.kafka import KafkaBus, ensure_topics

    s = _settings(config)
    _logging()

    async def main() -> None:
        await ensure_topics(s.kafka)
        ch = open_clickhouse(s.clickhouse)
        migrate(ch, s.clickhouse.database)
        apply_identity_retention(ch, s.clickhouse.database, s.sink.identity_retention_days)
        bus = KafkaBus(s.kafka, "kvgate-sink")
        await bus.start()
        sink = Sink(s.kafka, s.sink, ch, s.clickhouse.database, bus)
        runner = None
        if s.sink.metrics_port is not None:
            from prometheus_client import CollectorRegistry

            from analytics.sink import SinkCollector
            from streams.metrics_http import serve_metrics

            registry = CollectorRegistry()
            registry.register(SinkCollector(sink))
            runner, _ = await serve_metrics(
                s.sink.metrics_host, s.sink.metrics_port, registry, sink.refresh_lag
            )
        try:
            await sink.run()
        finally:
            if runner is not None:
                await runner.cleanup()
            await bus.stop()
            ch.close()

    asyncio.run(main())


@app.command()
def autoscale(config: ConfigOpt = None) -> None:
    """Run the autoscaling signal: desired replicas per pool and model from the heartbeats and
    decisions, as the gauge kvgate_autoscale_desired_replicas and kvgate.control scale messages
    (settings: autoscale.*; docs/operations.md). On start it rebuilds the arrival history from
    the decision log in ClickHouse (autoscale.history_from_clickhouse)."""
    from analytics.autoscaler import AutoscaleService, load_history
    from analytics.clickhouse import open_clickhouse
    from streams.kafka import KafkaBus, ensure_topics
    from streams.metrics_http import serve_metrics

    s = _settings(config)
    _logging()

    def query(sql: str) -> list[dict[str, Any]]:
        ch = open_clickhouse(s.clickhouse)  # chDB: fails while the sink holds the path
        try:
            return ch.query(sql)
        finally:
            ch.close()

    async def history() -> dict[tuple[str, str], list[float]]:
        if not s.autoscale.history_from_clickhouse or s.autoscale.mode != "predictive":
            return {}
        return await load_history(
            query,
            s.clickhouse.database,
            s.autoscale,
            time.time(),
            timeout_s=s.autoscale.history_timeout_s,
        )

    async def main() -> None:
        await ensure_topics(s.kafka)
        bus = KafkaBus(s.kafka, "kvgate-autoscale")
        await bus.start()
        service = AutoscaleService(s.kafka, s.autoscale, bus)
        service.seed(await history())
        runner = None
        if s.autoscale.metrics_port is not None:
            runner, port = await serve_metrics(
                s.autoscale.metrics_host, s.autoscale.metrics_port, service.registry
            )
            logging.getLogger(__name__).info("autoscale metrics on :%d", port)
        try:
            await service.run()
        finally:
            if runner is not None:
                await runner.cleanup()
            await bus.stop()

    asyncio.run(main())


@app.command()
def infra(
    action: Annotated[str, typer.Argument(help="start | stop | status")],
    config: ConfigOpt = None,
) -> None:
    """Start, stop or check the local Kafka (KRaft) and Redis from the repo's launchers."""
    from deploy.procs import LocalInfra

    if action not in ("start", "stop", "status"):
        raise typer.BadParameter("action must be start, stop or status")
    s = _settings(config)
    infra_ = LocalInfra.from_settings(s.kafka.bootstrap_servers, s.redis.url)
    failed = False
    for which in ("kafka", "redis"):
        res = infra_.run(which, action)
        out = (res.stdout + res.stderr).decode().strip()
        if action == "status":
            out = "up" if res.returncode == 0 else "down"
        typer.echo(f"{which}: {out}")
        failed |= res.returncode != 0
    if failed:
        raise typer.Exit(1)


@app.command()
def replay(
    trace: Annotated[
        str | None,
        typer.Option(
            help="Mooncake .jsonl or Azure .csv trace, or a generated workload: shared_prompt, "
            "multi_turn, zipf_hot, long_tail"
        ),
    ] = None,
    from_clickhouse: Annotated[
        bool, typer.Option("--from-clickhouse", help="replay recorded traffic from ClickHouse")
    ] = False,
    since: Annotated[
        str,
        typer.Option(
            help="recorded window start: last (the last run of the past day: after the last "
            "5 minutes without traffic), -2h, epoch, or ISO 8601 (UTC)"
        ),
    ] = "last",
    until: Annotated[str, typer.Option(help="recorded window end")] = "now",
    router_id: Annotated[
        str | None, typer.Option(help="only this router's recorded traffic")
    ] = None,
    baseline_config: Annotated[
        Path | None,
        typer.Option(help="settings of the current system (default: the environment's)"),
    ] = None,
    html: Annotated[Path | None, typer.Option(help="also write the HTML report here")] = None,
    nodes: Annotated[int, typer.Option(help="simulated engines")] = 16,
    policy: Annotated[
        str | None, typer.Option(help="routing policy (default: the config's)")
    ] = None,
    load: Annotated[float | None, typer.Option(help="offered load / capacity (e.g. 0.8)")] = None,
    limit: Annotated[int | None, typer.Option(help="first N requests only")] = None,
    capacity: Annotated[
        float | None, typer.Option(help="capacity in req/s (default: measured)")
    ] = None,
    ttft_slo: Annotated[float, typer.Option(help="TTFT target (s)")] = 2.0,
    tpot_slo: Annotated[float, typer.Option(help="TPOT target (s)")] = 0.1,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
    config: ConfigOpt = None,
) -> None:
    """Replay traffic through simulated engines in virtual time. With --from-clickhouse: the
    recorded decisions and outcomes of a window, under the current settings and the candidate
    settings of --config, side by side with what was recorded. With --trace: a trace file or
    workload under --config's policy and weights (one run), or, with --html, current vs. candidate.
    """
    if from_clickhouse or html is not None:
        _tuning_report(
            trace,
            from_clickhouse,
            since,
            until,
            router_id,
            baseline_config,
            config,
            html,
            nodes,
            limit,
            ttft_slo,
            tpot_slo,
            json_output,
        )
        return
    if trace is None:
        raise typer.BadParameter("give --trace FILE|WORKLOAD or --from-clickhouse")
    from analytics.sim.replay import replay as run_replay
    from router.decision.policies import POLICIES

    router = _settings(config).router
    if policy is not None:
        if policy not in POLICIES:
            raise typer.BadParameter(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        router = router.model_copy(update={"policy": policy})
    from analytics.progress import status

    try:
        with status(f"replaying {trace} through {nodes} simulated engines"):
            result = run_replay(
                trace,
                nodes=nodes,
                policy=router,
                load=load,
                limit=limit,
                seed=seed,
                capacity=capacity,
            )
    except (FileNotFoundError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    if json_output:
        typer.echo(json.dumps(result))
        return
    for key, value in result.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        typer.echo(f"{key:>22}  {shown}")


@app.command()
def report(
    out: Annotated[Path, typer.Option(help="the HTML file to write")] = Path("kvgate-report.html"),
    trace: Annotated[
        str | None, typer.Option(help="a trace file or workload instead of ClickHouse")
    ] = None,
    since: Annotated[
        str,
        typer.Option(
            help="recorded window start: last (the last run of the past day), -2h, epoch, ISO"
        ),
    ] = "last",
    until: Annotated[str, typer.Option(help="recorded window end")] = "now",
    router_id: Annotated[str | None, typer.Option(help="only this router's traffic")] = None,
    baseline_config: Annotated[
        Path | None, typer.Option(help="settings of the current system")
    ] = None,
    nodes: Annotated[int, typer.Option(help="simulated engines (trace files)")] = 16,
    limit: Annotated[int | None, typer.Option(help="first N requests only")] = None,
    ttft_slo: Annotated[float, typer.Option(help="TTFT target (s)")] = 2.0,
    tpot_slo: Annotated[float, typer.Option(help="TPOT target (s)")] = 0.1,
    config: ConfigOpt = None,
) -> None:
    """A self-contained HTML report (tables and plots) of recorded traffic replayed under the
    current and the candidate (--config) settings; for readers without Grafana."""
    _tuning_report(
        trace,
        trace is None,
        since,
        until,
        router_id,
        baseline_config,
        config,
        out,
        nodes,
        limit,
        ttft_slo,
        tpot_slo,
        False,
    )


def _recorded_trace(
    s: Settings, since: str, until: str, router_id: str | None, limit: int | None
) -> tuple[Recorded, Trace]:
    """The decisions and outcomes recorded in ClickHouse in a window, and their traffic as a
    trace (``typer.BadParameter`` when the window is bad, empty or ClickHouse unreachable)."""
    import time

    from analytics.clickhouse import open_clickhouse
    from analytics.exceptions import ClickHouseError
    from analytics.recorded import last_run, load_recorded, to_trace
    from analytics.tuning import parse_when

    now = time.time()
    last = since.strip() == "last"
    try:
        t0, t1 = parse_when("-1d" if last else since, now), parse_when(until, now)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        ch = open_clickhouse(s.clickhouse)
    except ClickHouseError as exc:
        raise typer.BadParameter(f"cannot open ClickHouse: {exc}") from exc
    db = s.clickhouse.database
    try:
        if last:  # the last run, not every run of the day merged
            t0 = last_run(ch, db, t0, t1, router_id) or t0
        rec = load_recorded(ch, db, t0, t1, router_id)
    finally:
        ch.close()
    if not rec.requests:
        raise typer.BadParameter("no recorded decisions in that window (see --since/--until)")
    span = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t0))} – " + (
        time.strftime("%H:%M:%S", time.gmtime(t1)) + " UTC"
    )
    which = "the last run" if last else "the window"
    typer.echo(f"replaying {which}: {span}, {len(rec.requests)} requests", err=True)
    tr = to_trace(rec, f"ClickHouse {db}, {which} {span}")
    return rec, tr.head(limit) if limit is not None else tr


def _tuning_report(
    trace: str | None,
    from_clickhouse: bool,
    since: str,
    until: str,
    router_id: str | None,
    baseline_config: Path | None,
    config: Path | None,
    html: Path | None,
    nodes: int,
    limit: int | None,
    ttft_slo: float,
    tpot_slo: float,
    json_output: bool,
) -> None:
    from analytics.sim.replay import open_trace
    from analytics.tuning import Candidate, compare, render_html, render_text

    if config is None:
        raise typer.BadParameter("--config names the candidate settings (a YAML file)")
    current_s = load_settings(baseline_config)
    candidate_s = _settings(config)

    def as_candidate(s: Settings) -> Candidate:
        return Candidate(s.router, s.admission, s.engine.profile)

    rec = None
    node_blocks: dict[str, int] | None = None
    if from_clickhouse:
        rec, tr = _recorded_trace(current_s, since, until, router_id, limit)
    else:
        if trace is None:
            raise typer.BadParameter("give --trace FILE|WORKLOAD or --from-clickhouse")
        try:
            tr = open_trace(trace, limit=limit)
        except (FileNotFoundError, ValueError) as exc:
            raise typer.BadParameter(str(exc)) from exc
        node_blocks = {f"node-{i:02d}": 0 for i in range(nodes)}
    from analytics.progress import status

    with status("replaying the traffic under the current and the candidate settings"):
        result = compare(
            rec,
            tr,
            as_candidate(current_s),
            as_candidate(candidate_s),
            node_blocks,
            ttft_slo,
            tpot_slo,
        )
    if html is not None:
        html.write_text(render_html(result))
    if json_output:
        typer.echo(json.dumps({k: v for k, v in result.items() if not k.startswith("_")}))
        return
    typer.echo(render_text(result))
    if html is not None:
        typer.echo(f"\nreport: {html}")


@app.command()
def plan(
    model: Annotated[
        str | None, typer.Option(help="model alias or Hugging Face id (see --profiles)")
    ] = None,
    gpu: Annotated[str | None, typer.Option(help="GPU alias: h100, h200, a100, l40s")] = None,
    tp: Annotated[
        int | None, typer.Option(help="GPUs per replica (default: the fewest that fit)")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option(help="a Mooncake .jsonl or Azure .csv trace")
    ] = None,
    workload: Annotated[
        str | None, typer.Option(help="a generated workload: multi_turn, conversation, ...")
    ] = None,
    from_clickhouse: Annotated[
        bool, typer.Option("--from-clickhouse", help="the traffic recorded in ClickHouse")
    ] = False,
    since: Annotated[str, typer.Option(help="recorded window start (-2h, epoch, ISO)")] = "-1d",
    until: Annotated[str, typer.Option(help="recorded window end")] = "now",
    rate: Annotated[
        float | None, typer.Option(help="requests per second to plan for (default: the trace's)")
    ] = None,
    slo: Annotated[
        str, typer.Option(help="ttft=S,tpot=S[,attainment=P]: targets and the share to meet")
    ] = "ttft=2,tpot=0.1,attainment=0.99",
    policy: Annotated[str, typer.Option(help="routing policy to plan with")] = "kvgate",
    baseline: Annotated[str, typer.Option(help="routing to compare with")] = "round_robin",
    requests: Annotated[int, typer.Option(min=100, help="requests measured")] = 2000,
    max_replicas: Annotated[int, typer.Option(min=1, help="search limit, in replicas")] = 256,
    max_gpus: Annotated[
        int | None, typer.Option(min=1, help="search limit, in GPUs (replicas × tp)")
    ] = None,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    profiles: Annotated[
        bool, typer.Option("--profiles", help="list the model/GPU profiles and exit")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
    html: Annotated[Path | None, typer.Option(help="also write an HTML report here")] = None,
    config: ConfigOpt = None,
) -> None:
    """Capacity plan: per-replica KV figures of MODEL on GPU, and the fewest replicas that meet
    the SLO at RATE in the simulator, beside the count one fewer and the baseline's count."""
    from agents.catalog import find_gpu, find_model
    from analytics.plan import parse_slo, profile_table
    from analytics.plan import plan as run_plan
    from analytics.planreport import render_html, render_text
    from router.decision.policies import POLICIES

    if profiles:
        typer.echo(profile_table())
        return
    if model is None or gpu is None:
        raise typer.BadParameter("give --model and --gpu (--profiles lists them)")
    if sum(x is not None and x is not False for x in (trace, workload, from_clickhouse)) != 1:
        raise typer.BadParameter("give one of --trace FILE, --workload NAME, --from-clickhouse")
    for name in (policy, baseline):
        if name not in POLICIES:
            raise typer.BadParameter(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    try:
        m, g, target = find_model(model), find_gpu(gpu), parse_slo(slo)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    source: str | Trace
    if workload is not None:
        source = workload
    elif trace is not None:
        from analytics.sim.traces import load_trace

        if not trace.exists():
            raise typer.BadParameter(f"{trace}: no such trace")
        source = load_trace(trace, seed=seed)
    else:
        _, source = _recorded_trace(_settings(config), since, until, None, None)
    if rate is None:
        if isinstance(source, str):
            raise typer.BadParameter("--rate is needed with --workload")
        span = max(1e-9, source.span_s)
        rate = (len(source.requests) - 1) / span
    began = time.monotonic()

    def told(routing: str, replicas: int, r: dict[str, Any]) -> None:
        """Each fleet as it is simulated, on stderr (the answer alone goes to stdout)."""
        a, p99 = r.get("slo_attainment"), r.get("ttft_p99_s")
        typer.echo(
            f"  {routing}: {replicas} replicas: SLO attainment "
            + (f"{a:.1%}" if a is not None else "–")
            + ", TTFT p99 "
            + (f"{p99:.3f} s" if p99 is not None else "–")
            + f" ({time.monotonic() - began:.0f} s)",
            err=True,
        )

    typer.echo(f"sizing a fleet of {m.alias} on {g.alias} in the simulator", err=True)
    try:
        report = run_plan(
            m,
            g,
            source,
            rate=rate,
            slo=target,
            tp=tp,
            policy=policy,
            baseline=baseline,
            requests=requests,
            max_replicas=max_replicas,
            max_gpus=max_gpus,
            seed=seed,
            progress=told,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if html is not None:
        html.write_text(render_html(report))
    if json_output:
        typer.echo(json.dumps(report))
        return
    typer.echo(render_text(report))
    if html is not None:
        typer.echo(f"report: {html}")


@app.command("tune")
def tune_cmd(
    trace: Annotated[
        str | None, typer.Option(help="a trace file (Mooncake .jsonl, Azure .csv) or workload")
    ] = None,
    from_clickhouse: Annotated[
        bool, typer.Option("--from-clickhouse", help="tune on traffic recorded in ClickHouse")
    ] = False,
    since: Annotated[str, typer.Option(help="recorded window start (-24h, epoch, ISO)")] = "-24h",
    until: Annotated[str, typer.Option(help="recorded window end")] = "now",
    router_id: Annotated[str | None, typer.Option(help="only this router's traffic")] = None,
    budget: Annotated[int, typer.Option(min=1, max=10_000, help="simulated trials")] = 200,
    objective: Annotated[str, typer.Option(help="goodput, slo or p99 (TTFT)")] = "goodput",
    nodes: Annotated[int, typer.Option(min=1, help="simulated engines (--trace)")] = 16,
    load: Annotated[
        float | None, typer.Option(help="offered load / capacity for --trace (e.g. 0.9)")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="first N requests only")] = None,
    ttft_slo: Annotated[float, typer.Option(help="TTFT target (s)")] = 2.0,
    tpot_slo: Annotated[float, typer.Option(help="TPOT target (s)")] = 0.1,
    seed: Annotated[int, typer.Option(help="the search's seed (same seed, same trials)")] = 0,
    out: Annotated[
        Path | None,
        typer.Option(
            help="write the best settings here (YAML, for kvgate weights), when they held on "
            "the held-out traffic"
        ),
    ] = None,
    html: Annotated[Path | None, typer.Option(help="also write the HTML report here")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
    config: ConfigOpt = None,
) -> None:
    """Search the kvgate policy's weights on the simulator (Optuna TPE, pruning, seeded) for
    recorded traffic or a trace; report the best next to the current settings' replay (and the
    recording), each weight's importance and sensitivity, and the best-scoring trials with
    where each is worse than the current settings (none of those is ever the best). --out
    writes the candidate for `kvgate weights --config candidate.yaml --version N` only when it
    differs from the current settings and is not worse on the last third of the traffic, which
    the search never saw; weights that fail that check exit with status 3, nothing written."""
    import yaml

    from analytics.sim.replay import capacity_rps, open_trace
    from analytics.sim.simconfig import SimConfig
    from analytics.tune import OBJECTIVES, offered_rps, summary, tune, verdict, with_weights
    from analytics.tune import render_html as tune_html
    from analytics.tune import render_text as tune_text
    from analytics.tuning import Candidate, compare, render_html, render_text

    if objective not in OBJECTIVES:
        raise typer.BadParameter(f"objective: one of {', '.join(OBJECTIVES)}")
    s = _settings(config)
    current = Candidate(
        s.router.model_copy(update={"policy": "kvgate"}), s.admission, s.engine.profile
    )
    rec = None
    if from_clickhouse == (trace is not None):
        raise typer.BadParameter("give --trace FILE|WORKLOAD or --from-clickhouse")
    if from_clickhouse:
        rec, tr = _recorded_trace(s, since, until, router_id, limit)
        on = rec.nodes
    else:
        assert trace is not None
        try:
            tr = open_trace(trace, limit=limit, seed=seed)
        except (FileNotFoundError, ValueError) as exc:
            raise typer.BadParameter(str(exc)) from exc
        on = {f"node-{i:02d}": 0 for i in range(nodes)}
        if load is not None:
            cap = capacity_rps(tr, SimConfig(nodes=nodes, profile=s.engine.profile))
            tr = tr.scaled(offered_rps(tr) / (load * cap))
    from analytics.progress import status

    with status(f"searching the weights: {budget} simulated trials of {len(tr.requests)} requests"):
        result = tune(
            tr,
            current,
            on,
            budget=budget,
            objective=objective,
            seed=seed,
            ttft_slo_s=ttft_slo,
            tpot_slo_s=tpot_slo,
        )
        candidate = with_weights(current, result.best)
        report = compare(rec, tr, current, candidate, on, ttft_slo, tpot_slo)
    search = summary(result, objective, budget)
    report["tuning"] = search
    written = out is not None and result.recommended
    if written:  # only weights that held on traffic the search never saw
        assert out is not None
        doc = {"router": {"policy": "kvgate", "cost": candidate.router.cost.model_dump()}}
        out.write_text(yaml.safe_dump(doc, sort_keys=False))
    if html is not None:
        html.write_text(render_html(report, "kvgate tune report", tune_html(search)))
    if json_output:
        typer.echo(json.dumps({k: v for k, v in report.items() if not k.startswith("_")}))
    else:
        typer.echo(tune_text(search) + "\n\n" + render_text(report))
        for path, what in ((out if written else None, "candidate"), (html, "report")):
            if path is not None:
                typer.echo(f"{what}: {path}")
    if out is not None and not written:
        typer.echo(f"{out} not written: {verdict(search)}", err=True)
        if result.best != result.current:  # weights that failed their validation
            raise typer.Exit(3)


TRACES = Path(__file__).resolve().parents[1] / "traces"  # shipped with the checkout
bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmarks (reports to <state>/benchmarks, or where --out says).",
)


BenchOut = Annotated[
    Path | None,
    typer.Option(
        help="output folder (default: <state>/benchmarks; --out docs/benchmarks to update the "
        "repository's reports)"
    ),
]


def _bench_out(out: Path | None) -> Path:
    """Where a benchmark writes: ``out``, else the state directory's ``benchmarks`` (the
    repository's docs/benchmarks only when asked for)."""
    return out if out is not None else home() / "benchmarks"


def _simulated_bench(
    name: str, run: Callable[..., object], out: Path | None, **params: object
) -> None:
    """Run a simulated benchmark that writes ``<name>.md`` and ``<name>.json`` with the command
    beside its numbers."""
    import sys

    folder = _bench_out(out)
    run(out_dir=folder, command="kvgate bench " + " ".join(sys.argv[2:]), **params)
    typer.echo(f"wrote {folder / (name + '.md')} and {folder / (name + '.json')}")


app.add_typer(bench_app, name="bench")


@bench_app.command("routing")
def bench_routing(
    traces_dir: Annotated[
        Path, typer.Option(help="folder with the public traces (default: the checkout's traces/)")
    ] = TRACES,
    nodes: Annotated[int, typer.Option(help="simulated engines")] = 16,
    loads: Annotated[str, typer.Option(help="comma-separated loads")] = "0.5,0.8,1.0,1.2",
    requests: Annotated[int, typer.Option(help="requests per workload (trace head)")] = 6000,
    workloads: Annotated[
        str,
        typer.Option(help="comma-separated: trace file names in traces_dir and generated names"),
    ] = (
        "mooncake_fast25_synthetic_trace.jsonl,azure_llm_inference_2023_conv.csv,"
        "shared_prompt,multi_turn,conversation,zipf_hot,long_tail"
    ),
    policies: Annotated[str, typer.Option(help="comma-separated policies (default: all)")] = "",
    jobs: Annotated[int, typer.Option(help="parallel simulations")] = 2,
    out: BenchOut = None,
    reuse: Annotated[
        bool,
        typer.Option(
            help="keep OUT/routing.json's runs: only --policies run again (none: no run), then "
            "the bounds, targets and tables are computed again (the workloads must be the "
            "ones it ran)"
        ),
    ] = False,
) -> None:
    """Every routing policy on public traces and generated workloads at several loads."""
    import sys

    out = _bench_out(out)

    from analytics.sim.bench import bench_routing as run
    from analytics.sim.bench import reuse as rebuild
    from analytics.sim.workloads import WORKLOADS
    from router.decision.policies import POLICIES

    sources: list[tuple[str, int | None]] = []
    for name in workloads.split(","):
        if name in WORKLOADS:
            sources.append((name, requests))
        else:
            path = traces_dir / name
            if not path.exists():
                raise typer.BadParameter(f"{path} does not exist")
            sources.append((str(path), requests))
    command = "kvgate bench " + " ".join(sys.argv[2:])
    named = [p for p in policies.split(",") if p]
    for p in named:
        if p not in POLICIES:
            raise typer.BadParameter(f"unknown policy {p!r}")
    if reuse:
        if not (out / "routing.json").exists():
            raise typer.BadParameter(f"{out / 'routing.json'} does not exist: nothing to reuse")
        try:
            rebuild(sources, out, command, named, jobs)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        typer.echo(f"wrote {out / 'routing.md'} and {out / 'routing.json'}")
        return
    chosen = named or list(POLICIES)
    run(
        sources,
        nodes=nodes,
        loads=[float(x) for x in loads.split(",")],
        out_dir=out,
        command=command,
        policies=chosen,
        jobs=jobs,
    )
    typer.echo(f"wrote {out / 'routing.md'} and {out / 'routing.json'}")


@bench_app.command("fleet")
def bench_fleet(
    nodes: Annotated[int, typer.Option(help="simulated engines")] = 8,
    requests: Annotated[int, typer.Option(help="requests of the multi_turn workload")] = 20_000,
    load: Annotated[float, typer.Option(help="offered load, share of capacity")] = 0.8,
    out: BenchOut = None,
) -> None:
    """Outlier ejection, slow start and drains in simulation, each against the run without."""
    from analytics.sim.fleetbench import bench_fleet as run

    _simulated_bench("fleet", run, out, nodes=nodes, requests=requests, load=load)


@bench_app.command("agentic")
def bench_agentic(
    nodes: Annotated[int, typer.Option(help="simulated engines")] = 8,
    load: Annotated[float, typer.Option(help="sessions' start rate, share of capacity")] = 0.8,
    repetitions: Annotated[int, typer.Option(help="runs per router (the simulator's seed)")] = 3,
    out: BenchOut = None,
) -> None:
    """Coding-agent sessions (AIPerf's agentic trace) in closed loop: kvgate, round-robin, peers."""
    from analytics.sim.agenticbench import bench_agentic as run

    _simulated_bench("agentic", run, out, nodes=nodes, load=load, repetitions=repetitions)


grafana_app = typer.Typer(
    no_args_is_help=True, help="Grafana dashboards on the ClickHouse decision log (as code)."
)
app.add_typer(grafana_app, name="grafana")


@grafana_app.command("build")
def grafana_build(
    out: Annotated[Path, typer.Option(help="output folder")] = Path("deploy/grafana/dashboards"),
    config: ConfigOpt = None,
) -> None:
    """Write the dashboards' JSON (for provisioning, or to import by hand)."""
    from deploy.grafana import write_dashboards

    for path in write_dashboards(out, _settings(config).clickhouse.database):
        typer.echo(path)


@grafana_app.command("check")
def grafana_check(
    hours: Annotated[float, typer.Option(help="time range: the last N hours")] = 24.0,
    config: ConfigOpt = None,
) -> None:
    """Run every panel's query against ClickHouse (macros expanded as the plugin does) and
    print how many rows each returns."""
    import time

    from analytics.clickhouse import open_clickhouse
    from analytics.exceptions import ClickHouseError
    from deploy.grafana import panel_queries

    s = _settings(config)
    ch = open_clickhouse(s.clickhouse)
    now = time.time()
    failed = 0
    try:
        for where, sql in panel_queries(s.clickhouse.database, now - hours * 3600, now):
            try:
                n = len(ch.query(sql))
            except ClickHouseError as exc:
                failed += 1
                typer.echo(f"FAIL  {where}: {exc}")
                continue
            typer.echo(f"{n:>6} rows  {where}")
    finally:
        ch.close()
    if failed:
        raise typer.Exit(1)


@grafana_app.command("push")
def grafana_push(
    url: Annotated[
        str, typer.Option(help="Grafana URL, http://user:password@host:3000 for basic auth")
    ] = "http://admin:admin@127.0.0.1:3000",
    token: Annotated[
        str | None, typer.Option(help="service-account token", envvar="KVGATE_GRAFANA_TOKEN")
    ] = None,
    datasource: Annotated[
        bool, typer.Option(help="also create or update the ClickHouse data source")
    ] = True,
    ch_protocol: Annotated[str, typer.Option(help="native or http")] = "http",
    config: ConfigOpt = None,
) -> None:
    """Publish kvgate's dashboards (and the ClickHouse data source) to a running Grafana."""
    from grafana_client.client import GrafanaException

    from deploy.grafana import datasource_model, push

    s = _settings(config).clickhouse
    ds = (
        datasource_model(s.host, s.port, s.database, s.username, ch_protocol, s.secure)
        if datasource
        else None
    )
    try:
        report = push(url, token, ds, s.password.get_secret_value() or None, db=s.database)
    except GrafanaException as exc:
        typer.echo(f"Grafana refused: {exc}", err=True)
        raise typer.Exit(1) from exc
    except OSError as exc:
        typer.echo(f"cannot reach Grafana at {url}: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"Grafana {report.grafana_version} at {url.split('@')[-1]}")
    if report.datasource:
        typer.echo(f"data source: {report.datasource}")
    typer.echo(f"folder: {report.folder}")
    for d in report.dashboards:
        typer.echo(f"dashboard: {d}")


# modules of the extras -> the extra that installs them
EXTRAS = {
    "opentelemetry": "otel",
    "grpc": "epp",
    "grpc_health": "epp",
    "envoy": "epp",
    "faust": "worker",
    "mode": "worker",
    "chdb": "analytics",
    "clickhouse_connect": "analytics",
    "grafana_client": "analytics",
    "matplotlib": "analytics",
    "optuna": "analytics",
    "statsmodels": "analytics",
}


# the control commands (weights, drain, undrain, canary) live in their own module
from deploy import controlcli  # noqa: E402,F401


def _stop_as_ctrl_c(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM or SIGHUP (what ``timeout``, CI runners, Docker and systemd send): stop as Ctrl-C
    does, so that a command tears down what it started (children, Kafka, Redis). (Even where
    SIGINT is ignored, as in a shell's background job: then as a KeyboardInterrupt.)"""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):  # Python's default (KeyboardInterrupt) or asyncio's (cancel the run)
        handler(signal.SIGINT, _frame)
        return
    raise KeyboardInterrupt


def main() -> None:
    # commands that handle SIGTERM themselves (the router, the agents) install their own
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_as_ctrl_c)
    try:
        app()
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        typer.echo(
            f"kvgate: this command needs the {extra!r} extra ({exc.name} is not installed): "
            f"pip install 'kvgate[{extra}]'",
            err=True,
        )
        raise SystemExit(2) from None
    except Exception as exc:  # infrastructure failures: a sentence, not a traceback
        sentence = explain(exc)
        if sentence is None or _LOG.get("level") == "DEBUG":
            raise
        typer.echo(f"kvgate: {sentence} (traceback: kvgate --log-level DEBUG …)", err=True)
        raise SystemExit(1) from None
