"""``kvgate plan``'s report as text and HTML: the headline answer, one replica's figures, and
per routing the fleet that meets the SLO beside the one a replica smaller, with why that one
fails (analytics/plan.py builds the report)."""

from __future__ import annotations

import html
from typing import Any

__all__ = ["misses", "render_html", "render_text"]


def _pct(v: Any) -> str:
    return f"{v:.1%}" if isinstance(v, float) else "–"


def _secs(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else "–"


def misses(r: dict[str, Any], slo: dict[str, Any]) -> str:
    """Why a simulated fleet falls short of the SLO, in words ("" when it meets it)."""
    need = slo["attainment"]
    if (r.get("slo_attainment") or 0.0) >= need:
        return ""
    parts = []
    refused = r.get("refused") or 0
    if refused:
        parts.append(f"{refused} requests refused")
    for key, what, limit in (
        ("ttft_attainment", "TTFT", slo["ttft_s"]),
        ("tpot_attainment", "TPOT", slo["tpot_s"]),
    ):
        share = r.get(key)
        if share is not None and share < need:
            parts.append(f"{share:.1%} within {what} ≤ {limit:g} s")
    if not parts:
        parts.append(f"{_pct(r.get('slo_attainment'))} within both")
    return "; ".join(parts) + f" (needs {need:.1%})"


_SHOWN = (("", "at_size"), (" (one fewer)", "one_fewer"))


def _fleet_row(label: str, r: dict[str, Any], report: dict[str, Any]) -> list[str]:
    return [
        label,
        str(r["replicas"]),
        str(r["replicas"] * report["tp"]),
        _pct(r["slo_attainment"]),
        _pct(r["hit_rate"]),
        _secs(r.get("ttft_p50_s")),
        _secs(r["ttft_p99_s"]),
        _secs(r.get("tpot_p99_s")),
        misses(r, report["slo"]) or "–",
    ]


def _fleet_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = [
        [
            "routing",
            "replicas",
            "GPUs",
            "SLO attainment",
            "hit rate",
            "TTFT p50 (s)",
            "TTFT p99 (s)",
            "TPOT p99 (s)",
            "misses the SLO by",
        ]
    ]
    for name, side in report["fleet"].items():
        shown = [(name + label, side[key]) for label, key in _SHOWN if side[key] is not None]
        if side["replicas"] is None and side["tried"]:
            best = max(side["tried"], key=lambda t: t["slo_attainment"] or 0.0)
            shown.append((f"{name} (best tried)", best))
        rows += [_fleet_row(label, r, report) for label, r in shown]
    return rows


def _replica_rows(report: dict[str, Any]) -> list[list[str]]:
    r = report["replica"]
    return [
        ["per replica", "value"],
        ["GPUs (tensor parallel)", str(r["gpus"])],
        ["weights", f"{r['weights_gib']} GiB ({r['weights_gib_per_gpu']} GiB per GPU)"],
        ["KV bytes per token", f"{r['kv_bytes_per_token']:,} B"],
        ["KV memory per GPU", f"{r['kv_memory_gib_per_gpu']} GiB"],
        ["KV blocks", f"{r['kv_blocks']:,} × {r['block_size']} tokens = {r['kv_tokens']:,}"],
        [
            "sequence length (prompt + output)",
            f"mean {r['mean_sequence_tokens']:,.0f}, p95 {r['p95_sequence_tokens']:,}",
        ],
        [
            "concurrent sequences that fit",
            f"{r['max_concurrent_at_mean']} at the mean, {r['max_concurrent_at_p95']} at p95 "
            f"(max_num_seqs {r['max_num_seqs']})",
        ],
    ]


_ENDED = {
    "plateau": "a bigger fleet improved neither attainment, TTFT nor TPOT: the requests' own "
    "service time misses the SLO, and more replicas cannot fix it",
    "limit": "the search limit (--max-replicas, --max-gpus) was reached",
}


def _headline(report: dict[str, Any]) -> str:
    s = report["slo"]
    ours_side = report["fleet"][report["policy"]]
    ours = ours_side["replicas"]
    theirs = report["fleet"][report["baseline"]]["replicas"]
    head = (
        f"{report['model']} on {report['tp']} × {report['gpu']} per replica; "
        f"{report['traffic']} at {report['rate_rps']:g} req/s ({report['requests']} requests); "
        f"SLO TTFT ≤ {s['ttft_s']:g} s and TPOT ≤ {s['tpot_s']:g} s for "
        f"{s['attainment']:.1%} of requests."
    )
    if ours is None and ours_side.get("why") == "alone":
        a = report["alone"]
        return head + (
            f" No fleet meets it: alone on an idle replica, {a['ttft']:.1%} of these requests "
            f"have their first token within {s['ttft_s']:g} s and {a['tpot']:.1%} decode within "
            f"{s['tpot_s']:g} s per token ({a['both']:.1%} both): a faster GPU, more GPUs per "
            "replica (--tp) or a looser SLO, not more replicas."
        )
    if ours is None:
        best = ours_side["best_attainment"] or 0.0
        why = _ENDED.get(ours_side.get("why", ""), "the search ended")
        return head + f" No fleet meets it: the best simulated attainment is {best:.1%} ({why})."
    tail = f" {report['policy']}: {ours} replicas ({ours * report['tp']} GPUs)"
    one_fewer = ours_side.get("one_fewer")
    if one_fewer is not None:
        tail += f"; {ours - 1} miss it: {misses(one_fewer, s)}"
    if theirs is not None:
        tail += f". {report['baseline']}: {theirs} replicas ({theirs * report['tp']} GPUs)"
    return head + tail + "."


def render_text(report: dict[str, Any]) -> str:
    lines = [_headline(report), ""]
    for rows in (_replica_rows(report), _fleet_rows(report)):
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        lines.append("")
    searched = report.get("search")
    if searched:
        lines.append(
            f"Simulated {searched['simulations']} fleets in {searched['seconds']:.0f} s "
            f"(the search started at {searched['start']} replicas, the analytic estimate)."
        )
    return "\n".join(lines).rstrip() + "\n"


def render_html(report: dict[str, Any]) -> str:
    from analytics.htmlpage import page, png_b64, pyplot, table

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, side in report["fleet"].items():
        pts = sorted((t["replicas"], t["slo_attainment"] or 0.0) for t in side["tried"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    ax.axhline(report["slo"]["attainment"], color="#888", ls="--", lw=1, label="target")
    ax.set_xlabel("replicas")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.02)
    ax.legend()
    body = (
        f"<p>{html.escape(_headline(report))}</p>"
        + table(_replica_rows(report))
        + table(_fleet_rows(report))
    )
    plots = [("SLO attainment against fleet size (every count simulated)", png_b64(fig))]
    return page("kvgate capacity plan", body, plots)
