"""kvgate's Grafana panels over the ClickHouse decision log, as data: the routing and admission
dashboards (:data:`DASHBOARDS`), each panel its SQL with the ClickHouse plugin's macros.
deploy/grafana.py renders them to Grafana's JSON, checks and publishes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ADMISSION", "DASHBOARDS", "ROUTING", "TENANT", "Dashboard", "Panel", "Query"]

PanelType = Literal["timeseries", "table", "stat", "barchart", "piechart"]


@dataclass(frozen=True, slots=True)
class Query:
    sql: str
    kind: Literal["timeseries", "table"] = "timeseries"


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    type: PanelType
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    w: int = 12
    h: int = 8
    stack: bool = False


@dataclass(frozen=True, slots=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    tags: tuple[str, ...] = ("kvgate",)
    variables: tuple[str, ...] = ("tenant",)


def _ts(sql: str) -> Query:
    return Query(sql.strip())


def _table(sql: str) -> Query:
    return Query(sql.strip(), "table")


def _p50_p99(title: str, column: Literal["ttft_s", "tpot_s"]) -> Panel:
    """The median and p99 of an outcome's ``column`` (seconds) over time, answered requests
    (``column``: one of the outcome table's own columns, never input)."""
    return Panel(
        title,
        "timeseries",
        (
            _ts(f"""
SELECT $__timeInterval(ts) AS time,
       quantile(0.5)({column}) AS p50, quantile(0.99)({column}) AS p99
FROM {{db}}.outcomes FINAL
WHERE $__timeFilter(ts) AND status = 'ok' AND {column} IS NOT NULL
GROUP BY time ORDER BY time"""),  # noqa: S608 (a column of the code's own)
        ),
        "s",
    )


TENANT = "match(tenant, '${tenant}')"

ROUTING = Dashboard(
    "kvgate-routing",
    "kvgate — routing",
    "Where requests went and why, prefix-cache hits, latency and load spread.",
    (
        Panel(
            "Routing decisions by node",
            "timeseries",
            (
                _ts("""
SELECT $__timeInterval(ts) AS time, ifNull(chosen_node, '(none)') AS node, count() AS decisions
FROM {db}.decisions FINAL
WHERE $__timeFilter(ts) AND admission = 'admitted' AND {tenant}
GROUP BY time, node ORDER BY time"""),
            ),
            "short",
            "Admitted requests per node.",
            stack=True,
        ),
        Panel(
            "Routing decisions by reason",
            "timeseries",
            (
                _ts("""
SELECT $__timeInterval(ts) AS time, reason, count() AS decisions
FROM {db}.decisions FINAL
WHERE $__timeFilter(ts) AND admission = 'admitted' AND {tenant}
GROUP BY time, reason ORDER BY time"""),
            ),
            "short",
            "prefix_hit, least_cost, spread, overload_fallback, all_overloaded, session_home, "
            "session_place (a long-context session's first turn, or one whose context was "
            "evicted, placed where resident contexts leave it room), session_overflow (no node "
            "has room: to the node most committed), session_move (a later turn off an overflow "
            "node whose queue is long), "
            "kv_pull (its prefix's KV loaded from the busy node holding it).",
            stack=True,
        ),
        Panel(
            "Prefix-cache hit rate",
            "timeseries",
            (
                _ts("""
SELECT $__timeInterval(ts) AS time,
       sum(ifNull(cached_tokens, 0)) / greatest(1, sum(prompt_tokens)) AS hit_rate
FROM {db}.outcomes FINAL
WHERE $__timeFilter(ts) AND status = 'ok'
GROUP BY time ORDER BY time"""),
            ),
            "percentunit",
            "Prompt tokens the engines reused from their KV cache / all prompt tokens.",
        ),
        Panel(
            "Top prefixes",
            "table",
            (
                _table("""
SELECT lower(hex(prefix)) AS prefix_hash, count() AS requests,
       sum(ifNull(cached_tokens, 0)) / greatest(1, sum(prompt_tokens)) AS hit_rate,
       uniqExact(chosen_node) AS nodes
FROM {db}.v_requests
WHERE $__timeFilter(ts) AND admission = 'admitted' AND prefix != 0 AND {tenant}
GROUP BY prefix_hash ORDER BY requests DESC LIMIT 10"""),
            ),
            "short",
            "The most requested prefixes (first block), their hit rate and the nodes serving them.",
        ),
        _p50_p99("TTFT p50 / p99", "ttft_s"),
        _p50_p99("TPOT p50 / p99", "tpot_s"),
        Panel(
            "By weights version (canary against current)",
            "table",
            (
                _table("""
SELECT weights_version, count() AS requests,
       sum(ifNull(cached_tokens, 0)) / greatest(1, sum(prompt_tokens)) AS hit_rate,
       quantile(0.5)(ttft_s) AS ttft_p50, quantile(0.99)(ttft_s) AS ttft_p99,
       quantile(0.99)(tpot_s) AS tpot_p99
FROM {db}.v_requests
WHERE $__timeFilter(ts) AND admission = 'admitted' AND status = 'ok' AND {tenant}
GROUP BY weights_version ORDER BY weights_version"""),
            ),
            "short",
            "During a weights canary (kvgate weights --canary) the candidate's requests carry "
            "its version: hit rate and latency of each version side by side.",
        ),
        Panel(
            "Node load spread",
            "timeseries",
            (
                _ts("""
SELECT bucket AS time, requests_cov AS cov, max_over_mean
FROM {db}.v_node_load_spread
WHERE $__timeFilter(bucket)
ORDER BY time"""),
            ),
            "short",
            "Across nodes, from heartbeats: coefficient of variation and max / mean of requests "
            "running + waiting. 0 and 1 are perfectly even.",
        ),
        Panel(
            "KV cache used per node",
            "timeseries",
            (
                _ts("""
SELECT bucket AS time, node_id AS node, kv_blocks_used / greatest(1, kv_blocks_total) AS used
FROM {db}.node_snapshots FINAL
WHERE $__timeFilter(bucket)
ORDER BY time"""),
            ),
            "percentunit",
        ),
        Panel(
            "SLO attainment",
            "timeseries",
            (
                _ts("""
SELECT $__timeInterval(ts) AS time,
       countIf(status = 'ok' AND ifNull(ttft_s, 0) <= ${ttft_slo_s}
               AND ifNull(tpot_s, 0) <= ${tpot_slo_s}) / count() AS attainment
FROM {db}.outcomes FINAL
WHERE $__timeFilter(ts)
GROUP BY time ORDER BY time"""),
            ),
            "percentunit",
            "Requests that finished within the TTFT and TPOT targets (dashboard variables) / all "
            "requests, refused ones included.",
            w=24,
        ),
    ),
    variables=("tenant", "ttft_slo_s", "tpot_slo_s"),
)

ADMISSION = Dashboard(
    "kvgate-admission",
    "kvgate — admission",
    "Who was refused and why, queues, reservations against what the engines use, estimates.",
    (
        Panel(
            "Rejections by reason",
            "timeseries",
            (
                _ts("""
SELECT $__timeInterval(ts) AS time, admission_reason AS reason, count() AS rejections
FROM {db}.decisions FINAL
WHERE $__timeFilter(ts) AND admission = 'rejected' AND {tenant}
GROUP BY time, reason ORDER BY time"""),
            ),
            "short",
            stack=True,
        ),
        Panel(
            "Rejections by priority and tenant",
            "table",
            (
                _table("""
SELECT priority, tenant, admission_reason AS reason, count() AS rejections
FROM {db}.decisions FINAL
WHERE $__timeFilter(ts) AND admission = 'rejected' AND {tenant}
GROUP BY priority, tenant, reason ORDER BY rejections DESC"""),
            ),
        ),
        Panel(
            "Queue depth (mean, by priority)",
            "timeseries",
            (
                _ts("""
SELECT $__timeInterval(ts) AS time, priority,
       sum(ifNull(queue_wait_s, 0)) / $__interval_s AS depth
FROM {db}.decisions FINAL
WHERE $__timeFilter(ts) AND queue_wait_s IS NOT NULL
GROUP BY time, priority ORDER BY time"""),
            ),
            "short",
            "Requests waiting in the admission queues on average over each interval (Little's "
            "law: the time they waited / the interval).",
        ),
        Panel(
            "Reserved vs. used KV blocks",
            "timeseries",
            (
                _ts("""
SELECT time, reserved FROM (
  SELECT $__timeInterval(ts) AS time,
         sum(sum(multiIf(kind = 'reserve', toInt64(kv_blocks),
                         kind IN ('release', 'expire'), -toInt64(kv_blocks), 0)))
           OVER (ORDER BY time) AS reserved
  FROM {db}.ledger_events FINAL
  WHERE ts <= $__toTime
  GROUP BY time
) WHERE time >= $__fromTime ORDER BY time"""),
                _ts("""
SELECT bucket AS time, sum(kv_blocks_used) AS used
FROM {db}.node_snapshots FINAL
WHERE $__timeFilter(bucket)
GROUP BY time ORDER BY time"""),
            ),
            "short",
            "KV blocks the reservations hold (from the ledger) and the blocks the engines report "
            "in use. Reservations above use: estimates too high; below: traffic bypassing kvgate.",
        ),
        Panel(
            "Admitted, queued and refused",
            "timeseries",
            (
                _ts("""
SELECT $__timeInterval(ts) AS time, admission, count() AS requests
FROM {db}.decisions FINAL
WHERE $__timeFilter(ts) AND {tenant}
GROUP BY time, admission ORDER BY time"""),
            ),
            stack=True,
        ),
        Panel(
            "Estimated / actual KV blocks",
            "timeseries",
            (
                _ts("""
SELECT $__timeInterval(ts) AS time, tenant, avg(estimate_over_actual) AS ratio
FROM {db}.v_kv_estimate
WHERE $__timeFilter(ts) AND {tenant}
GROUP BY time, tenant ORDER BY time"""),
            ),
            "short",
            "What reservations were sized for / what requests needed (prompt + actual output). "
            "1 is exact; above 1 the budget is conservative.",
        ),
    ),
)

DASHBOARDS: tuple[Dashboard, ...] = (ROUTING, ADMISSION)
