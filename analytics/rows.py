"""Topic values → ClickHouse rows (pure)."""

from __future__ import annotations

from typing import Any

import orjson

from streams.schemas import Decision, Outcome

__all__ = ["decision_row", "outcome_row"]


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
