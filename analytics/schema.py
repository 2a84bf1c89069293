"""ClickHouse schema as ordered, versioned migrations (applied once each, recorded in a table).

Sink tables are ReplacingMergeTree keyed by the message identity, with the Kafka offset as the
version: a batch re-inserted after a crash collapses onto the rows already there, and every query
that counts reads ``FINAL``.
"""

from __future__ import annotations

import time

from analytics.clickhouse import ClickHouse

__all__ = ["MIGRATIONS", "migrate"]

MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (
        1,
        "decisions and outcomes",
        [
            """CREATE TABLE IF NOT EXISTS {db}.decisions (
            request_id String,
            ts DateTime64(6),
            router_id LowCardinality(String),
            tenant LowCardinality(String),
            priority LowCardinality(String),
            model LowCardinality(String),
            pool LowCardinality(String),
            session_id Nullable(String),
            endpoint_kind LowCardinality(String),
            prompt_tokens UInt32,
            max_tokens UInt32,
            block_size UInt16,
            block_hashes Array(Int64),
            approximate_tokens Bool,
            admission LowCardinality(String),
            admission_reason LowCardinality(String),
            policy LowCardinality(String),
            weights_version UInt32,
            chosen_node Nullable(String),
            reason LowCardinality(String),
            candidate_nodes Array(String),
            candidate_scores Array(Float64),
            candidate_hit_blocks Array(UInt32),
            candidates_json String,
            index_age_s Nullable(Float64),
            decision_us Float64,
            kafka_partition UInt16,
            kafka_offset UInt64
        ) ENGINE = ReplacingMergeTree(kafka_offset)
        PARTITION BY toYYYYMMDD(ts)
        ORDER BY (toStartOfHour(ts), request_id)
        TTL toDateTime(ts) + INTERVAL 30 DAY""",
            """CREATE TABLE IF NOT EXISTS {db}.outcomes (
            request_id String,
            ts DateTime64(6),
            router_id LowCardinality(String),
            node_id Nullable(String),
            status LowCardinality(String),
            http_status UInt16,
            ttft_s Nullable(Float64),
            tpot_s Nullable(Float64),
            e2e_s Float64,
            prompt_tokens UInt32,
            output_tokens UInt32,
            cached_tokens Nullable(UInt32),
            reroutes UInt8,
            error Nullable(String),
            kafka_partition UInt16,
            kafka_offset UInt64
        ) ENGINE = ReplacingMergeTree(kafka_offset)
        PARTITION BY toYYYYMMDD(ts)
        ORDER BY (toStartOfHour(ts), request_id)
        TTL toDateTime(ts) + INTERVAL 30 DAY""",
        ],
    ),
    (
        2,
        "admission budget on decisions",
        [
            "ALTER TABLE {db}.decisions ADD COLUMN IF NOT EXISTS budget_usage Nullable(Float64)",
            "ALTER TABLE {db}.decisions ADD COLUMN IF NOT EXISTS "
            "kv_blocks_estimate Nullable(UInt32)",
        ],
    ),
    (
        3,
        "admission queue wait and learned output estimate on decisions",
        [
            "ALTER TABLE {db}.decisions ADD COLUMN IF NOT EXISTS "
            "output_tokens_estimate Nullable(UInt32)",
            "ALTER TABLE {db}.decisions ADD COLUMN IF NOT EXISTS queue_wait_s Nullable(Float64)",
        ],
    ),
]


def migrate(ch: ClickHouse, database: str) -> list[int]:
    """Apply the migrations not applied yet; returns their versions."""
    ch.command(f"CREATE DATABASE IF NOT EXISTS {database}")
    ch.command(
        f"CREATE TABLE IF NOT EXISTS {database}.schema_migrations "
        "(version UInt32, name String, applied_at DateTime64(3)) "
        "ENGINE = ReplacingMergeTree ORDER BY version"
    )
    done = {
        int(r["version"])
        for r in ch.query(f"SELECT version FROM {database}.schema_migrations FINAL")
    }
    applied = []
    for version, name, statements in MIGRATIONS:
        if version in done:
            continue
        for sql in statements:
            ch.command(sql.format(db=database))
        ch.insert_json(
            f"{database}.schema_migrations",
            [{"version": version, "name": name, "applied_at": time.time()}],
        )
        applied.append(version)
    return applied
