"""The ``kvgate`` command: one subcommand per component, plus the demo and tooling."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from deploy.failures import explain
from deploy.logs import configure
from deploy.settings import Settings, load_settings, public_dump

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


# the node's commands (engine, agent) first in the help, as the components are listed there
from deploy import nodecli  # noqa: E402,F401


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


# the other commands live in modules of their own (each adds its commands to ``app``): control
# messages (weights, drain, undrain, canary), replay and report, plan and tune, bench and grafana
from deploy import benchcli, controlcli, plancli, replaycli  # noqa: E402,F401


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
