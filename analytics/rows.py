"""Topic values → ClickHouse rows (pure)."""

from __future__ import annotations

from typing import Any

import orjson

from streams.schemas import Decision, Heartbeat, LedgerEvent, Outcome

__all__ = ["decision_row", "ledger_row", "node_row", "outcome_row", "snapshot_bucket"]


def decision_row(d: Decision, partition: int, offset: int) -> dict[str, Any]:
    row = d.model_dump(exclude={"candidates", "schema_version"})
    row["candidate_nodes"] = [c.node_id for c in d.candidates]
    row["candidate_scores"] = [c.score for c in d.candidates]
    row["candidate_hit_blocks"] = [c.hit_blocks for c in d.candidates]
    row["candidates_json"] = orjson.dumps([c.model_dump() for c in d.candidates]).decode()
    row["kafka_partition"] = partition
    row["kafka_offset"] = offset
    return row


def outcome_row(o: Outcome, partition: int, offset: int) -> dict[str, Any]:
    row = o.model_dump(exclude={"schema_version"})
    row["kafka_partition"] = partition
    row["kafka_offset"] = offset
    return row


def snapshot_bucket(ts: float, interval_s: float) -> int:
    """The start (epoch seconds) of the snapshot interval ``ts`` falls in."""
    return int(ts // interval_s * interval_s)


def node_row(hb: Heartbeat, interval_s: float, partition: int, offset: int) -> dict[str, Any]:
    return {
        "bucket": snapshot_bucket(hb.ts, interval_s),
        "ts": hb.ts,
        "node_id": hb.node_id,
        "pool": hb.pool,
        "model": hb.model,
        "kv_blocks_total": hb.kv_blocks_total,
        "kv_blocks_used": hb.kv_blocks_used,
        "running": hb.running,
        "waiting": hb.waiting,
        "prompt_tokens_per_s": hb.prompt_tokens_per_s,
        "generation_tokens_per_s": hb.generation_tokens_per_s,
        "prefix_cache_hit_rate": hb.prefix_cache_hit_rate,
        "healthy": hb.healthy,
        "draining": hb.draining,
        "kafka_partition": partition,
        "kafka_offset": offset,
    }


def ledger_row(ev: LedgerEvent, partition: int, offset: int) -> dict[str, Any]:
    row = ev.model_dump(exclude={"schema_version"})
    row["kafka_partition"] = partition
    row["kafka_offset"] = offset
    return row
