"""``kvgate plan`` and ``kvgate tune``: the cluster a workload needs, and weights searched on
recorded traffic (each validated before it is written)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from deploy.cli import ConfigOpt, _settings, app
from deploy.replaycli import _recorded_trace

if TYPE_CHECKING:
    from analytics.sim.traces import Trace

__all__ = ["plan", "tune_cmd"]


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
