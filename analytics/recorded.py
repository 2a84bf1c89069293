"""Recorded traffic from the decision log, as a replayable trace and as metrics.

:func:`load_recorded` reads one time window of ``decisions`` joined with ``outcomes`` (and the
nodes' snapshots); :func:`to_trace` turns it into the simulator's :class:`Trace` — arrivals,
the prompts' block hashes, lengths, sessions, priorities, tenants — and :func:`recorded_metrics`
measures what actually happened with the same definitions the simulator's metrics use.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from analytics.clickhouse import ClickHouse
from analytics.sim.metrics import latency_and_spread
from analytics.sim.traces import Trace, TraceRequest

__all__ = ["Recorded", "RecordedRequest", "load_recorded", "recorded_metrics", "to_trace"]

_PRIORITIES = ("high", "normal", "low")


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    request_id: str
    ts: float  # when the router decided (after any wait in the admission queue)
    tenant: str
    priority: str
    session_id: str | None
    prompt_tokens: int
    max_tokens: int
    block_size: int
    block_hashes: tuple[int, ...]
    admission: str
    admission_reason: str
    chosen_node: str | None
    reason: str
    queue_wait_s: float
    output_tokens_estimate: int | None
    # from the outcome (None: no outcome recorded)
    status: str | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    output_tokens: int | None
    cached_tokens: int | None

    @property
    def arrival_s(self) -> float:
        return self.ts - self.queue_wait_s


@dataclass(frozen=True, slots=True)
class Recorded:
    requests: tuple[RecordedRequest, ...]
    nodes: dict[str, int]  # node id -> KV blocks it reported (largest seen)
    since: float
    until: float


def _lit(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


RUN_GAP_S = 300.0  # minutes without a decision longer than this separate two runs


def last_run(
    ch: ClickHouse,
    db: str,
    since: float,
    until: float,
    router_id: str | None = None,
    gap_s: float = RUN_GAP_S,
) -> float | None:
    """When the last run in [since, until] began: the first minute with decisions after the
    last stretch of more than ``gap_s`` without any (None: no decision in the window). Counted
    per minute, so a day of traffic is at most 1,440 rows."""
    where = f"ts >= toDateTime64({since:.6f}, 6) AND ts <= toDateTime64({until:.6f}, 6)"
    if router_id:
        where += f" AND router_id = {_lit(router_id)}"
    minutes = [
        float(r["m"])
        for r in ch.query(f"""
            SELECT toUInt32(toStartOfMinute(ts)) AS m FROM {db}.decisions
            WHERE {where} GROUP BY m ORDER BY m""")
    ]
    if not minutes:
        return None
    start = minutes[-1]
    for earlier in reversed(minutes[:-1]):
        if start - earlier - 60.0 > gap_s:  # (the gap: between the end of one, start of next)
            break
        start = earlier
    return max(start, since)


def load_recorded(
    ch: ClickHouse, db: str, since: float, until: float, router_id: str | None = None
) -> Recorded:
    """Decisions in [since, until] (epoch seconds) with their outcomes; ``router_id`` narrows it
    to one router's traffic."""
    where = f"d.ts >= toDateTime64({since:.6f}, 6) AND d.ts <= toDateTime64({until:.6f}, 6)"
    # a request once: its first decision (a re-route is decision_seq 1 on), only requests that
    # reached admission (refusals of bad input or credentials have nothing to replay), and no
    # pass-through (embeddings and the like: no tokens, not routed by cache)
    where += " AND d.decision_seq = 0 AND d.reason != 'refused_before_admission'"
    where += " AND d.policy != 'passthrough'"
    if router_id:
        where += f" AND d.router_id = {_lit(router_id)}"
    rows = ch.query(f"""
        SELECT d.request_id AS request_id, toFloat64(d.ts) AS ts, d.tenant AS tenant,
               d.priority AS priority, d.session_id AS session_id,
               d.prompt_tokens AS prompt_tokens, d.max_tokens AS max_tokens,
               d.block_size AS block_size, d.block_hashes AS block_hashes,
               d.admission AS admission, d.admission_reason AS admission_reason,
               d.chosen_node AS chosen_node, d.reason AS reason,
               ifNull(d.queue_wait_s, 0) AS queue_wait_s,
               d.output_tokens_estimate AS output_tokens_estimate,
               o.request_id != '' AS has_outcome,
               o.status AS status, o.ttft_s AS ttft_s, o.tpot_s AS tpot_s, o.e2e_s AS e2e_s,
               o.output_tokens AS output_tokens, o.cached_tokens AS cached_tokens
        FROM {db}.decisions AS d FINAL
        LEFT JOIN (SELECT * FROM {db}.outcomes FINAL) AS o ON o.request_id = d.request_id
        WHERE {where}
        ORDER BY ts, request_id
        SETTINGS join_use_nulls = 1""")
    requests = tuple(_request(r) for r in rows)
    nodes = {
        str(r["node_id"]): int(r["blocks"])
        for r in ch.query(f"""
            SELECT node_id, max(kv_blocks_total) AS blocks FROM {db}.node_snapshots FINAL
            WHERE bucket >= toDateTime({int(since) - 60}) AND bucket <= toDateTime({int(until)})
            GROUP BY node_id ORDER BY node_id""")
    }
    for r in requests:  # nodes that served traffic but left no snapshot in the window
        if r.chosen_node and r.chosen_node not in nodes:
            nodes[r.chosen_node] = 0
    return Recorded(requests, nodes, since, until)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _request(r: dict[str, Any]) -> RecordedRequest:
    has = bool(r.get("has_outcome")) and r.get("status") is not None
    return RecordedRequest(
        request_id=str(r["request_id"]),
        ts=float(r["ts"]),
        tenant=str(r["tenant"]),
        priority=str(r["priority"]),
        session_id=r["session_id"],
        prompt_tokens=int(r["prompt_tokens"]),
        max_tokens=int(r["max_tokens"]),
        block_size=int(r["block_size"]),
        block_hashes=tuple(int(h) for h in r["block_hashes"]),
        admission=str(r["admission"]),
        admission_reason=str(r["admission_reason"]),
        chosen_node=r["chosen_node"],
        reason=str(r["reason"]),
        queue_wait_s=float(r["queue_wait_s"] or 0.0),
        output_tokens_estimate=_opt_int(r["output_tokens_estimate"]),
        status=str(r["status"]) if has else None,
        ttft_s=_opt_float(r["ttft_s"]) if has else None,
        tpot_s=_opt_float(r["tpot_s"]) if has else None,
        e2e_s=_opt_float(r["e2e_s"]) if has else None,
        output_tokens=_opt_int(r["output_tokens"]) if has else None,
        cached_tokens=_opt_int(r["cached_tokens"]) if has else None,
    )


def _output_tokens(r: RecordedRequest, cap: int) -> int:
    """What the request produced, or (refused, failed) what it would most likely have."""
    if r.status == "ok" and r.output_tokens:
        return r.output_tokens
    if r.output_tokens_estimate:
        return max(1, min(r.max_tokens or cap, r.output_tokens_estimate))
    return max(1, min(r.max_tokens or cap, cap))


def to_trace(rec: Recorded, name: str = "recorded", output_cap: int = 512) -> Trace:
    """The recorded window as a trace: every request offered to kvgate, refused ones included
    (the candidate may admit them), at its original arrival time."""
    if not rec.requests:
        raise ValueError("no recorded decisions in that window")
    block_size = Counter(r.block_size for r in rec.requests).most_common(1)[0][0]
    requests = sorted(
        (
            TraceRequest(
                arrival_s=r.arrival_s,
                prompt_tokens=r.prompt_tokens,
                output_tokens=_output_tokens(r, output_cap),
                block_hashes=r.block_hashes if r.block_size == block_size else (),
                session_id=r.session_id,
                priority=r.priority if r.priority in _PRIORITIES else "normal",  # type: ignore[arg-type]
                client=r.tenant,
                request_id=r.request_id,
            )
            for r in rec.requests
        ),
        key=lambda t: t.arrival_s,
    )
    return Trace(name, block_size, tuple(requests))


def recorded_metrics(
    rec: Recorded, ttft_slo_s: float = 2.0, tpot_slo_s: float = 0.1
) -> dict[str, Any]:
    """What happened, with the simulator's metric definitions (:func:`run_metrics`)."""
    ok = [r for r in rec.requests if r.status == "ok"]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    good = [
        r
        for r in ok
        if (r.ttft_s or 0.0) <= ttft_slo_s and (r.tpot_s is None or r.tpot_s <= tpot_slo_s)
    ]
    per_node = Counter(r.chosen_node for r in ok if r.chosen_node)
    loads = [per_node.get(n, 0) for n in rec.nodes] or [0]
    offered = len(rec.requests)
    first = min((r.arrival_s for r in rec.requests), default=0.0)
    last = max((r.ts + (r.e2e_s or 0.0) for r in rec.requests), default=0.0)
    span = max(1e-9, last - first)
    return {
        "requests": len(ok),
        "offered": offered,
        **latency_and_spread(ttft, tpot, e2e, loads),
        "hit_rate": cached / prompt if prompt else 0.0,
        "slo_attainment": len(good) / offered if offered else 0.0,
        "throughput_rps": len(ok) / span,
        "goodput_rps": len(good) / span,
        "reasons": dict(Counter(r.reason for r in ok)),
        "rejections": dict(
            Counter(r.admission_reason for r in rec.requests if r.admission == "rejected")
        ),
        "per_node": dict(per_node),
    }
