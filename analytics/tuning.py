"""Tune on recorded traffic: replay a window of the decision log under the configuration that
recorded it and under a candidate, and put the three side by side.

* **recorded** — what happened (ClickHouse outcomes);
* **replay: current** — the same traffic through the simulator with the current settings (how
  far the simulator is from the live system; it is the fair baseline for the candidate);
* **replay: candidate** — the candidate's routing weights and admission settings.

The report lists the metrics, refusals by reason, and the decisions that changed (node and
reason, against the recording and against the current settings' replay), so a reader sees not
only *whether* the candidate is better but *where* it decides differently and why.
"""

from __future__ import annotations

import html
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from admission.settings import AdmissionSettings
from agents.profile import EngineProfile
from analytics.htmlpage import page, png_b64, pyplot, table
from analytics.recorded import Recorded, recorded_metrics
from analytics.sim.admission import Refused
from analytics.sim.cluster import simulate
from analytics.sim.metrics import run_metrics
from analytics.sim.simconfig import SimConfig, acting_on
from analytics.sim.traces import Trace
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = [
    "Candidate",
    "ReplaySide",
    "compare",
    "parse_when",
    "render_html",
    "render_text",
    "replay_side",
]

REFUSED = "(refused)"
METRICS = (
    ("requests", "served requests", "{:.0f}"),
    ("hit_rate", "prefix hit rate", "{:.1%}"),
    ("ttft_p50_s", "TTFT p50", "{:.3f} s"),
    ("ttft_p99_s", "TTFT p99", "{:.3f} s"),
    ("tpot_p50_s", "TPOT p50", "{:.4f} s"),
    ("tpot_p99_s", "TPOT p99", "{:.4f} s"),
    ("slo_attainment", "SLO attainment (of offered)", "{:.1%}"),
    ("load_cov", "load CoV", "{:.3f}"),
    ("max_over_mean_load", "load max/mean", "{:.2f}"),
    ("refused", "refused", "{:.0f}"),
)


@dataclass(frozen=True, slots=True)
class Candidate:
    """What a replay varies: routing (policy and weights), admission, and the engines' model."""

    router: RouterSettings
    admission: AdmissionSettings
    profile: EngineProfile


@dataclass(slots=True)
class ReplaySide:
    name: str
    metrics: dict[str, Any]
    # request id -> (node or "(refused)", reason, prompt blocks the engine reused; None: unknown)
    decisions: dict[str, tuple[str, str, int | None]]
    settings_summary: dict[str, Any] = field(default_factory=dict)
    finish: list[tuple[float, float]] = field(default_factory=list)  # (arrival, TTFT)


def _summary(s: Candidate) -> dict[str, Any]:
    out: dict[str, Any] = {"policy": s.router.policy}
    weights = s.router.cost if s.router.policy == "kvgate" else s.router.weights
    out.update({f"weight {k}": v for k, v in sorted(weights.model_dump().items())})
    a = s.admission
    out.update(
        {
            "admission": a.enabled,
            "yellow / red": f"{a.yellow_watermark} / {a.red_watermark}",
            "slots_per_node": a.slots_per_node,
        }
    )
    return out


def replay_side(
    name: str,
    trace: Trace,
    settings: Candidate,
    nodes: dict[str, int],
    ttft_slo_s: float = 2.0,
    tpot_slo_s: float = 0.1,
) -> ReplaySide:
    """``trace`` through the simulator on the recorded nodes under ``settings``."""
    node_ids = tuple(sorted(nodes)) or ("node-00",)
    profile = settings.profile
    blocks = max(nodes.values(), default=0)
    if blocks > 0:  # the engines' KV as they reported it (in the trace's block size)
        profile = profile.model_copy(
            update={"num_gpu_blocks_override": blocks, "block_size": trace.block_size}
        )
    cfg = SimConfig(
        nodes=len(node_ids),
        node_ids=node_ids,
        profile=profile,
        admission=settings.admission if settings.admission.enabled else None,
    )
    cfg = acting_on(cfg, settings.router)
    refused: list[Refused] = []
    done = simulate(trace, make_policy(settings.router), cfg, {}, refused)
    m = run_metrics(
        done,
        len(node_ids),
        trace.block_size,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        node_ids=node_ids,
    )
    offered = len(trace.requests)
    final = [r for r in refused if r.final]
    m["offered"] = offered
    m["refused"] = len(final)
    m["rejections"] = dict(Counter(str(r.reason) for r in final))
    m["slo_attainment"] = m.get("slo_attainment", 0.0) * len(done) / offered if offered else 0.0
    m["per_node"] = dict(Counter(d.node for d in done))
    decisions: dict[str, tuple[str, str, int | None]] = {}
    for d in done:
        if d.request.request_id:
            decisions[d.request.request_id] = (
                d.node,
                d.reason,
                d.cached_tokens // trace.block_size,
            )
    for r in final:
        rid = trace.requests[r.index].request_id
        if rid:
            decisions[rid] = (REFUSED, str(r.reason), None)
    finish = [(d.request.arrival_s, d.first_token_s - d.request.arrival_s) for d in done]
    return ReplaySide(name, m, decisions, _summary(settings), sorted(finish))


def _recorded_side(rec: Recorded, ttft_slo_s: float, tpot_slo_s: float) -> ReplaySide:
    m = recorded_metrics(rec, ttft_slo_s, tpot_slo_s)
    m["refused"] = sum(m["rejections"].values())
    decisions: dict[str, tuple[str, str, int | None]] = {}
    for r in rec.requests:
        if r.admission == "rejected":
            decisions[r.request_id] = (REFUSED, r.admission_reason, None)
        elif r.chosen_node:
            reused = None if r.cached_tokens is None else r.cached_tokens // r.block_size
            decisions[r.request_id] = (r.chosen_node, r.reason, reused)
    finish = sorted(
        (r.arrival_s, r.ttft_s) for r in rec.requests if r.status == "ok" and r.ttft_s is not None
    )
    return ReplaySide("recorded", m, decisions, {}, finish)


def _tie(x: tuple[str, str, int | None], y: tuple[str, str, int | None]) -> bool:
    """The same reason and as many prompt blocks reused, on two different nodes."""
    return REFUSED not in (x[0], y[0]) and x[1] == y[1] and x[2] is not None and x[2] == y[2]


def _changes(a: ReplaySide, b: ReplaySide, sample: int = 15) -> dict[str, Any]:
    """Where ``b`` decided differently from ``a``, request by request. Another node for the same
    reason with as many prompt blocks reused is a tie (two holders of the prefix, either as good):
    counted apart (``ties``), not as a change."""
    common = sorted(set(a.decisions) & set(b.decisions))
    moved = [rid for rid in common if a.decisions[rid][0] != b.decisions[rid][0]]
    ties = [rid for rid in moved if _tie(a.decisions[rid], b.decisions[rid])]
    tied = set(ties)
    changed = [rid for rid in moved if rid not in tied]
    why = Counter(f"{a.decisions[rid][1]} → {b.decisions[rid][1]}" for rid in changed)
    admitted_now = sum(
        1 for rid in changed if a.decisions[rid][0] == REFUSED and b.decisions[rid][0] != REFUSED
    )
    refused_now = sum(
        1 for rid in changed if b.decisions[rid][0] == REFUSED and a.decisions[rid][0] != REFUSED
    )
    return {
        "compared": len(common),
        "changed": len(changed),
        "changed_share": len(changed) / len(common) if common else 0.0,
        "ties": len(ties),
        "now_admitted": admitted_now,
        "now_refused": refused_now,
        "by_reason": dict(why.most_common()),
        "sample": [
            {
                "request_id": rid,
                "from_node": a.decisions[rid][0],
                "from_reason": a.decisions[rid][1],
                "to_node": b.decisions[rid][0],
                "to_reason": b.decisions[rid][1],
            }
            for rid in changed[:sample]
        ],
    }


def compare(
    rec: Recorded | None,
    trace: Trace,
    current: Candidate,
    candidate: Candidate,
    nodes: dict[str, int] | None = None,
    ttft_slo_s: float = 2.0,
    tpot_slo_s: float = 0.1,
) -> dict[str, Any]:
    """The report: ``rec`` (None for a trace file: then only the two replays) next to the replays
    of ``trace`` under ``current`` and ``candidate`` on ``nodes`` (default: the recorded ones)."""
    started = time.perf_counter()
    if any(r.request_id is None for r in trace.requests):  # a trace file: name requests by index
        trace = Trace(
            trace.name,
            trace.block_size,
            tuple(
                r if r.request_id else replace(r, request_id=f"#{i}")
                for i, r in enumerate(trace.requests)
            ),
        )
    on = nodes if nodes is not None else (rec.nodes if rec is not None else {})
    base = replay_side("replay: current", trace, current, on, ttft_slo_s, tpot_slo_s)
    cand = replay_side("replay: candidate", trace, candidate, on, ttft_slo_s, tpot_slo_s)
    sides = [base, cand]
    report: dict[str, Any] = {
        "window": {
            "since": trace.requests[0].arrival_s,
            "until": trace.requests[-1].arrival_s,
            "requests": len(trace.requests),
            "source": trace.name,
        },
        "nodes": on,
        "slo": {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s},
        "changes_vs_current": _changes(base, cand),
    }
    if rec is not None:
        recorded = _recorded_side(rec, ttft_slo_s, tpot_slo_s)
        sides.insert(0, recorded)
        report["window"].update(since=rec.since, until=rec.until)
        report["changes_vs_recorded"] = _changes(recorded, cand)
        report["current_vs_recorded"] = _changes(recorded, base)
    report["sides"] = {
        side.name: {"metrics": side.metrics, "settings": side.settings_summary} for side in sides
    }
    report["wall_s"] = round(time.perf_counter() - started, 2)
    report["_series"] = {s.name: s.finish for s in sides}
    return report


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_when(text: str, now: float) -> float:
    """Epoch seconds from ``now``, an epoch number, a relative ``-30m`` / ``-2h`` / ``-1d``, or
    an ISO 8601 time (UTC unless it names its zone)."""
    from datetime import UTC, datetime

    t = text.strip()
    if t == "now":
        return now
    if t.startswith("-") and t[-1:] in _UNITS:
        return now - float(t[1:-1]) * _UNITS[t[-1]]
    try:
        return float(t)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(t)
    except ValueError as exc:
        raise ValueError(
            f"{text!r}: expected now, -30m / -2h / -1d, epoch seconds or an ISO 8601 time"
        ) from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "—"
    try:
        return spec.format(value)
    except (TypeError, ValueError):
        return str(value)


def _rows(report: dict[str, Any]) -> list[list[str]]:
    names = list(report["sides"])
    rows = [["metric", *names]]
    for key, label, spec in METRICS:
        rows.append([label, *(_fmt(report["sides"][n]["metrics"].get(key), spec) for n in names)])
    reasons = sorted({r for n in names for r in report["sides"][n]["metrics"]["rejections"]})
    for reason in reasons:
        rows.append(
            [
                f"  refused: {reason}",
                *(str(report["sides"][n]["metrics"]["rejections"].get(reason, 0)) for n in names),
            ]
        )
    return rows


def render_text(report: dict[str, Any]) -> str:
    rows = _rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for key, title in (
        ("changes_vs_current", "decisions the candidate changes (vs replay: current)"),
        ("changes_vs_recorded", "decisions the candidate changes (vs recorded)"),
    ):
        if key not in report:
            continue
        c = report[key]
        lines += [
            "",
            f"{title}: {c['changed']} of {c['compared']} ({c['changed_share']:.1%}); "
            f"now admitted {c['now_admitted']}, now refused {c['now_refused']}; "
            f"{c['ties']} ties (another node, as much reused) not counted",
        ]
        lines += [f"  {n:>6}  {why}" for why, n in list(c["by_reason"].items())[:8]]
    if "current_vs_recorded" in report:
        fid = report["current_vs_recorded"]
        lines += [
            "",
            f"simulator vs live (replay: current vs recorded): {fid['changed_share']:.1%} of "
            f"decisions differ ({fid['ties']} ties besides)",
        ]
    return "\n".join(lines)


def _plots(report: dict[str, Any]) -> list[tuple[str, str]]:
    plt = pyplot()
    png = png_b64
    out: list[tuple[str, str]] = []
    sides = report["sides"]

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, series in report["_series"].items():
        if series:
            t0 = series[0][0]
            ax.plot([a - t0 for a, _ in series], [v for _, v in series], ".", ms=3, label=name)
    ax.set_xlabel("arrival (s into the window)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.legend()
    out.append(("TTFT of every request", png(fig)))

    fig, ax = plt.subplots(figsize=(8, 3.5))
    nodes = sorted({n for s in sides.values() for n in s["metrics"].get("per_node", {})})
    width = 0.8 / max(1, len(sides))
    for i, (name, s) in enumerate(sides.items()):
        per = s["metrics"].get("per_node", {})
        xs = [j + i * width for j in range(len(nodes))]
        ax.bar(xs, [per.get(n, 0) for n in nodes], width, label=name)
    ax.set_xticks([j + width for j in range(len(nodes))], nodes, rotation=45, ha="right")
    ax.set_ylabel("requests")
    ax.legend()
    out.append(("Requests per node", png(fig)))

    fig, ax = plt.subplots(figsize=(8, 3))
    names = list(sides)
    ax.bar(names, [sides[n]["metrics"].get("hit_rate", 0.0) for n in names], color="#4c72b0")
    ax.set_ylabel("prefix hit rate")
    ax.set_ylim(0, 1)
    out.append(("Prefix-cache hit rate", png(fig)))
    return out


def render_html(
    report: dict[str, Any], title: str = "kvgate replay report", extra: str = ""
) -> str:
    """A self-contained page (plots inlined): for readers without Grafana."""
    e = html.escape
    body_table = table(_rows(report))
    settings = ""
    for name, side in report["sides"].items():
        if side["settings"]:
            items = "".join(
                f"<tr><td>{e(str(k))}</td><td>{e(str(v))}</td></tr>"
                for k, v in side["settings"].items()
            )
            settings += f"<h3>{e(name)}</h3><table>{items}</table>"
    changes = ""
    for key, head in (
        ("changes_vs_current", "Decisions the candidate changes, against the current settings"),
        ("changes_vs_recorded", "Decisions the candidate changes, against the recording"),
    ):
        if key not in report:
            continue
        c = report[key]
        reasons = "".join(
            f"<tr><td>{e(why)}</td><td>{n}</td></tr>" for why, n in c["by_reason"].items()
        )
        sample = "".join(
            "<tr>"
            + "".join(
                f"<td>{e(str(s[k]))}</td>"
                for k in ("request_id", "from_node", "from_reason", "to_node", "to_reason")
            )
            + "</tr>"
            for s in c["sample"]
        )
        changes += (
            f"<h2>{e(head)}</h2><p>{c['changed']} of {c['compared']} decisions "
            f"({c['changed_share']:.1%}); now admitted {c['now_admitted']}, now refused "
            f"{c['now_refused']}; {c['ties']} ties (another node for the same reason, as many "
            f"prompt blocks reused) are not counted.</p><table><tr><th>reason before → after"
            f"</th><th>requests</th></tr>{reasons}</table><table><tr><th>request</th>"
            f"<th>node before</th><th>reason before</th><th>node after</th>"
            f"<th>reason after</th></tr>{sample}</table>"
        )
    w = report["window"]
    span = (
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(w['since']))} – "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(w['until']))} UTC"
    )
    fidelity = ""
    if "current_vs_recorded" in report:
        share = report["current_vs_recorded"]["changed_share"]
        fidelity = (
            f"The simulator's replay of the current settings differs from the recording in "
            f"{share:.1%} of decisions ({report['current_vs_recorded']['ties']} ties besides): "
            f"compare the candidate with <em>replay: current</em>."
        )
    body = (
        f"<p>{w['requests']} requests ({e(str(w['source']))}), {span}; "
        f"{len(report['nodes'])} nodes. SLO: TTFT ≤ {report['slo']['ttft_s']} s, "
        f"TPOT ≤ {report['slo']['tpot_s']} s. {fidelity}</p>\n{body_table}\n"
        f"{extra}<h2>Settings</h2>{settings}\n{changes}"
    )
    return page(title, body, _plots(report))
