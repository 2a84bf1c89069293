"""ClickHouse schema as ordered, versioned migrations (applied once each, recorded in a table).

Sink tables are ReplacingMergeTree keyed by the message identity, with the Kafka offset as the
version: a batch re-inserted after a crash collapses onto the rows already there, and every query
that counts reads ``FINAL``.
"""

from __future__ import annotations

import time

from analytics.clickhouse import ClickHouse

__all__ = ["IDENTITY_COLUMNS", "MIGRATIONS", "apply_identity_retention", "migrate"]

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
    (
        4,
        "node snapshots, ledger events and the views the panels and reports read",
        [
            # one row per node per snapshot interval (the sink downsamples heartbeats)
            """CREATE TABLE IF NOT EXISTS {db}.node_snapshots (
            bucket DateTime,
            ts DateTime64(3),
            node_id LowCardinality(String),
            pool LowCardinality(String),
            model LowCardinality(String),
            kv_blocks_total UInt32,
            kv_blocks_used UInt32,
            running UInt32,
            waiting UInt32,
            prompt_tokens_per_s Float64,
            generation_tokens_per_s Float64,
            prefix_cache_hit_rate Float64,
            healthy Bool,
            draining Bool,
            kafka_partition UInt16,
            kafka_offset UInt64
        ) ENGINE = ReplacingMergeTree(kafka_offset)
        PARTITION BY toYYYYMMDD(bucket)
        ORDER BY (node_id, bucket)
        TTL bucket + INTERVAL 30 DAY""",
            """CREATE TABLE IF NOT EXISTS {db}.ledger_events (
            ts DateTime64(6),
            reservation_id String,
            pool LowCardinality(String),
            kind LowCardinality(String),
            kv_blocks UInt32,
            slots UInt16,
            router_id LowCardinality(String),
            lease_expires_at Nullable(Float64),
            cause Nullable(String),
            kafka_partition UInt16,
            kafka_offset UInt64
        ) ENGINE = ReplacingMergeTree(kafka_offset)
        PARTITION BY toYYYYMMDD(ts)
        ORDER BY (toStartOfHour(ts), kafka_partition, kafka_offset)
        TTL toDateTime(ts) + INTERVAL 30 DAY""",
            # a request's prefix is its first block (a shared system prompt starts there)
            """CREATE OR REPLACE VIEW {db}.v_requests AS
            SELECT d.request_id AS request_id, d.ts AS ts, d.tenant AS tenant,
                   d.priority AS priority, d.model AS model, d.pool AS pool,
                   d.session_id AS session_id, d.prompt_tokens AS prompt_tokens,
                   d.max_tokens AS max_tokens, d.block_size AS block_size,
                   if(length(d.block_hashes) > 0, d.block_hashes[1], 0) AS prefix,
                   d.admission AS admission, d.admission_reason AS admission_reason,
                   d.kv_blocks_estimate AS kv_blocks_estimate, d.chosen_node AS chosen_node,
                   d.reason AS reason, d.weights_version AS weights_version,
                   o.status AS status, o.ttft_s AS ttft_s, o.tpot_s AS tpot_s, o.e2e_s AS e2e_s,
                   o.output_tokens AS output_tokens, o.cached_tokens AS cached_tokens,
                   o.reroutes AS reroutes
            FROM {db}.decisions AS d FINAL
            LEFT JOIN (SELECT * FROM {db}.outcomes FINAL) AS o ON o.request_id = d.request_id""",
            """CREATE OR REPLACE VIEW {db}.v_prefix_hit_rate AS
            SELECT prefix, count() AS requests, sum(prompt_tokens) AS prompt_sum,
                   sum(ifNull(cached_tokens, 0)) AS cached_sum,
                   cached_sum / greatest(1, prompt_sum) AS hit_rate,
                   uniqExact(chosen_node) AS nodes, min(ts) AS first_ts, max(ts) AS last_ts
            FROM {db}.v_requests WHERE admission = 'admitted' AND prefix != 0
            GROUP BY prefix""",
            """CREATE OR REPLACE VIEW {db}.v_node_load_spread AS
            SELECT bucket, count() AS nodes, avg(running + waiting) AS mean_requests,
                   max(running + waiting) AS max_requests,
                   if(avg(running + waiting) = 0, 0,
                      stddevPop(running + waiting) / avg(running + waiting)) AS requests_cov,
                   if(avg(running + waiting) = 0, 1,
                      max(running + waiting) / avg(running + waiting)) AS max_over_mean,
                   avg(kv_blocks_used / greatest(1, kv_blocks_total)) AS mean_kv_used,
                   max(kv_blocks_used / greatest(1, kv_blocks_total)) AS max_kv_used
            FROM {db}.node_snapshots FINAL GROUP BY bucket""",
            """CREATE OR REPLACE VIEW {db}.v_rejections AS
            SELECT toStartOfMinute(ts) AS minute, admission_reason AS reason, priority, tenant,
                   count() AS rejections
            FROM {db}.decisions FINAL WHERE admission = 'rejected'
            GROUP BY minute, reason, priority, tenant""",
            # what the reservation was sized for vs. what the request turned out to need
            """CREATE OR REPLACE VIEW {db}.v_kv_estimate AS
            SELECT request_id, ts, tenant, model, kv_blocks_estimate,
                   toUInt32(ceil((prompt_tokens + output_tokens) / block_size)) AS kv_blocks_actual,
                   kv_blocks_estimate / greatest(1, kv_blocks_actual) AS estimate_over_actual
            FROM {db}.v_requests
            WHERE admission = 'admitted' AND status = 'ok' AND kv_blocks_estimate IS NOT NULL""",
        ],
    ),
    (
        5,
        "the client's X-Request-Id as a label on decisions (request_id is minted by kvgate)",
        [
            "ALTER TABLE {db}.decisions ADD COLUMN IF NOT EXISTS "
            "client_request_id Nullable(String)",
        ],
    ),
    (
        6,
        "rows deduplicate on message identity: decisions on (request, decision_seq), ledger "
        "events on (reservation, kind, ts); ledger events carry the tenant",
        [
            "ALTER TABLE {db}.decisions ADD COLUMN IF NOT EXISTS decision_seq UInt8, "
            "MODIFY ORDER BY (toStartOfHour(ts), request_id, decision_seq)",
            """CREATE TABLE IF NOT EXISTS {db}.ledger_events_v2 (
            ts DateTime64(6),
            reservation_id String,
            pool LowCardinality(String),
            kind LowCardinality(String),
            kv_blocks UInt32,
            slots UInt16,
            tenant Nullable(String),
            router_id LowCardinality(String),
            lease_expires_at Nullable(Float64),
            cause Nullable(String),
            kafka_partition UInt16,
            kafka_offset UInt64
        ) ENGINE = ReplacingMergeTree(kafka_offset)
        PARTITION BY toYYYYMMDD(ts)
        ORDER BY (toStartOfHour(ts), reservation_id, kind, ts)
        TTL toDateTime(ts) + INTERVAL 30 DAY""",
            "INSERT INTO {db}.ledger_events_v2 (ts, reservation_id, pool, kind, kv_blocks, slots, "
            "router_id, lease_expires_at, cause, kafka_partition, kafka_offset) "
            "SELECT ts, reservation_id, pool, kind, kv_blocks, slots, router_id, "
            "lease_expires_at, cause, kafka_partition, kafka_offset FROM {db}.ledger_events",
            "RENAME TABLE {db}.ledger_events TO {db}.ledger_events_v1, "
            "{db}.ledger_events_v2 TO {db}.ledger_events",
            "DROP TABLE {db}.ledger_events_v1",
        ],
    ),
    (
        7,
        "disaggregated prefill: the node that computed the prompt on decisions",
        [
            "ALTER TABLE {db}.decisions ADD COLUMN IF NOT EXISTS prefill_node Nullable(String)",
        ],
    ),
    (
        8,
        "streams continued on another node after their engine failed mid-answer",
        [
            "ALTER TABLE {db}.outcomes ADD COLUMN IF NOT EXISTS resumes UInt8 DEFAULT 0",
        ],
    ),
    (
        9,
        "pulls: the node a prompt's prefix KV was loaded from, and its blocks, on decisions",
        [
            "ALTER TABLE {db}.decisions ADD COLUMN IF NOT EXISTS pull_node Nullable(String)",
            "ALTER TABLE {db}.decisions ADD COLUMN IF NOT EXISTS pull_blocks UInt32 DEFAULT 0",
        ],
    ),
]


# columns that can identify a user: kept only ``identity_retention_days`` (a column TTL)
IDENTITY_COLUMNS = {"decisions": ("session_id", "client_request_id")}


def apply_identity_retention(ch: ClickHouse, database: str, days: int) -> None:
    """Column TTLs for the user-identifying fields (the sink applies the setting on start; 0
    clears them at once and the sink stops writing them)."""
    for table, columns in IDENTITY_COLUMNS.items():
        for column in columns:
            ttl = f"toDateTime(ts) + INTERVAL {max(0, int(days))} DAY"
            ch.command(
                f"ALTER TABLE {database}.{table} MODIFY COLUMN {column} Nullable(String) TTL {ttl}"
            )


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
