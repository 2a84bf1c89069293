"""Run summaries computed by SQL on ClickHouse (the demo's closing report)."""

from __future__ import annotations

from typing import Any

from analytics.clickhouse import ClickHouse

__all__ = ["run_summary"]


def _q(router_id: str) -> str:
    return "'" + router_id.replace("\\", "\\\\").replace("'", "\\'") + "'"


def run_summary(ch: ClickHouse, db: str, router_id: str) -> dict[str, Any]:
    """Everything one router recorded: outcomes, decisions, per-node share, hit rate, latency."""
    rid = _q(router_id)
    o = ch.query(f"""
        SELECT count() AS requests,
               countIf(status != 'ok') AS errors,
               sum(prompt_tokens) AS prompt_sum,
               sum(ifNull(cached_tokens, 0)) AS cached_sum,
               if(sum(prompt_tokens) = 0, 0, sum(ifNull(cached_tokens, 0)) / sum(prompt_tokens))
                 AS hit_rate,
               quantileExactIf(0.5)(ttft_s, ttft_s IS NOT NULL) AS ttft_p50_s,
               quantileExactIf(0.99)(ttft_s, ttft_s IS NOT NULL) AS ttft_p99_s,
               quantileExactIf(0.5)(tpot_s, tpot_s IS NOT NULL) AS tpot_p50_s,
               quantileExactIf(0.99)(tpot_s, tpot_s IS NOT NULL) AS tpot_p99_s,
               sum(output_tokens) AS output_sum,
               min(ts) AS first_ts, max(ts) AS last_ts
        FROM {db}.outcomes FINAL WHERE router_id = {rid}""")[0]
    d = ch.query(f"""
        SELECT count() AS decision_rows,
               quantileExactIf(0.5)(decision_us, reason != 'refused_before_admission'
                 AND policy != 'passthrough') AS decision_p50_us,
               quantileExactIf(0.99)(decision_us, reason != 'refused_before_admission'
                 AND policy != 'passthrough') AS decision_p99_us
        FROM {db}.decisions FINAL WHERE router_id = {rid}""")[0]
    share = ch.query(f"""
        SELECT ifNull(node_id, '(none)') AS node, count() AS requests,
               sum(ifNull(cached_tokens, 0)) / greatest(1, sum(prompt_tokens)) AS node_hit_rate
        FROM {db}.outcomes FINAL WHERE router_id = {rid}
        GROUP BY node ORDER BY node""")
    reasons = ch.query(f"""
        SELECT reason, count() AS decisions FROM {db}.decisions FINAL
        WHERE router_id = {rid} GROUP BY reason ORDER BY decisions DESC""")
    total = max(1, int(o["requests"]))
    return {
        "requests": int(o["requests"]),
        "errors": int(o["errors"]),
        "hit_rate": float(o["hit_rate"]),
        "prompt_tokens": int(o["prompt_sum"]),
        "cached_tokens": int(o["cached_sum"]),
        "output_tokens": int(o["output_sum"]),
        "ttft_p50_s": _num(o["ttft_p50_s"]),
        "ttft_p99_s": _num(o["ttft_p99_s"]),
        "tpot_p50_s": _num(o["tpot_p50_s"]),
        "tpot_p99_s": _num(o["tpot_p99_s"]),
        "decision_rows": int(d["decision_rows"]),
        "outcome_rows": int(o["requests"]),
        "decision_p50_us": _num(d["decision_p50_us"]),
        "decision_p99_us": _num(d["decision_p99_us"]),
        "per_node": {
            r["node"]: {
                "requests": int(r["requests"]),
                "share": int(r["requests"]) / total,
                "hit_rate": float(r["node_hit_rate"]),
            }
            for r in share
        },
        "reasons": {r["reason"]: int(r["decisions"]) for r in reasons},
    }


def _num(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return None if f != f else f  # NaN → None
