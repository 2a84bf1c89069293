"""Faust as the worker runs it: the changes to faust-streaming 0.15.3 it applies
(:mod:`streams.faustcommit`, :mod:`streams.faustpatch`) and the app's settings."""

from __future__ import annotations

from pathlib import Path

import faust

from streams.faustcommit import (
    allow_commit_bursts,
    commit_on_a_fixed_cadence,
    commit_transactions_together,
    flush_before_transaction_commit,
    write_tables_before_commit,
)
from streams.faustpatch import (
    commit_folded_offsets,
    dispatch_without_tasks,
    fold_input_inline,
    restore_only_settled_changelogs,
)
from streams.settings import KafkaSettings, WorkerSettings
from streams.tables import app_id

__all__ = ["faust_app"]

PRODUCER_BATCH_BYTES = 512 * 1024  # a commit's table records of one partition: a few batches
COMMIT_BURST = 100_000  # table records one commit may write before Faust holds the input up


def _patch_faust(kafka: KafkaSettings, worker: WorkerSettings) -> None:
    """Faust as kvgate runs it (streams/faustcommit.py, streams/faustpatch.py)."""
    write_tables_before_commit()
    commit_folded_offsets()
    dispatch_without_tasks()
    fold_input_inline()
    allow_commit_bursts(COMMIT_BURST)
    commit_on_a_fixed_cadence()
    if worker.exactly_once:
        flush_before_transaction_commit()
        commit_transactions_together()
        restore_only_settled_changelogs(kafka)


def faust_app(kafka: KafkaSettings, worker: WorkerSettings) -> faust.App:
    """A Faust app configured and patched as the worker runs it (its topics, tables and
    folds are :func:`streams.app.build_app`'s)."""
    _patch_faust(kafka, worker)
    # Faust creates its data directory without parents: started anywhere, it must exist
    Path(worker.data_dir).mkdir(parents=True, exist_ok=True)
    return faust.App(
        app_id(kafka, worker),
        broker=f"kafka://{kafka.bootstrap_servers}",
        store="memory://",
        processing_guarantee="exactly_once" if worker.exactly_once else "at_least_once",
        topic_partitions=kafka.partitions,
        topic_replication_factor=kafka.replication_factor,
        web_enabled=True,
        web_bind=worker.web_host,
        web_port=worker.web_port,
        web_in_thread=False,
        broker_commit_interval=worker.commit_interval_s,
        broker_session_timeout=worker.session_timeout_s,
        broker_rebalance_timeout=worker.rebalance_timeout_s,
        broker_heartbeat_interval=worker.heartbeat_interval_s,
        consumer_auto_offset_reset="earliest",
        producer_linger_ms=5,
        producer_max_request_size=8 * 1024 * 1024,
        producer_max_batch_size=PRODUCER_BATCH_BYTES,
        table_standby_replicas=0,
        datadir=worker.data_dir,
        key_serializer="raw",
        value_serializer="raw",
    )
