"""``kvgate replay`` and ``kvgate report``: a trace (a file, a generated workload, or the
decisions and outcomes recorded in ClickHouse) run through the simulator, and the report of a
recorded window."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from deploy.cli import ConfigOpt, _settings, app
from deploy.settings import Settings, load_settings

if TYPE_CHECKING:
    from analytics.recorded import Recorded
    from analytics.sim.traces import Trace

__all__ = ["replay", "report"]


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
