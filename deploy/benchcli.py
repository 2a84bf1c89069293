"""``kvgate bench`` (the simulated benchmarks) and ``kvgate grafana`` (kvgate's dashboards
built, checked against a live Grafana, pushed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from deploy.cli import ConfigOpt, _settings, app
from streams.home import home

__all__ = ["bench_app", "grafana_app"]


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
