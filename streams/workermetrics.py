"""The worker's ``/metrics`` page: what it folded, dead-lettered and wrote, what its tables hold,
how long its commits take, and how far its consumer is behind its inputs."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = ["input_lag", "render_metrics"]

SOURCES = ("heartbeats", "kv_events", "ledger")
TABLES = ("prefix_index", "load", "kv_ledger")
PHASES = ("write", "send", "commit")
_NONE = (0.0, 0, 0.0)


def input_lag(consumer: Any, inputs: Mapping[str, str]) -> Counter[str]:
    """Input records not yet committed, by source (``inputs``: topic -> source), over the
    partitions ``consumer`` holds."""
    lag: Counter[str] = Counter()
    for tp in consumer.assignment():
        source = inputs.get(tp.topic)
        if source is None:
            continue
        committed = consumer._committed_offset.get(tp)
        with contextlib.suppress(Exception):
            lag[source] += max(0, consumer.highwater(tp) - (committed or 0))
    return lag


def render_metrics(
    folded: Mapping[str, int],
    written: Mapping[str, int],
    nodes: int,
    entries: int,
    commit_seconds: Mapping[str, list[float]],
    lag: Mapping[str, int],
) -> str:
    """Prometheus text: ``folded`` input by source (and ``dead_lettered``, ``reread``,
    ``recovery_reread``), ``written`` table records by table, ``nodes`` in the load table,
    ``entries`` in the prefix index, ``commit_seconds`` phase -> [sum, count, last], ``lag`` by
    source."""
    lines: list[str] = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
        suffix = "_total" if kind == "counter" else ""
        lines.extend(f"{name}{suffix}{labels} {value}" for labels, value in samples)

    family(
        "kvgate_worker_folded",
        "counter",
        "Input messages folded into the tables, by source",
        [(f'{{source="{src}"}}', folded.get(src, 0)) for src in SOURCES],
    )
    family(
        "kvgate_worker_dead_lettered",
        "counter",
        "Input messages sent to the dead-letter topic",
        [("", folded.get("dead_lettered", 0))],
    )
    family(
        "kvgate_worker_input_rereads",
        "counter",
        "Times an input partition was read again from a record that was never delivered",
        [("", folded.get("reread", 0))],
    )
    family(
        "kvgate_worker_recovery_rereads",
        "counter",
        "Times a changelog partition under recovery was read again: its records were fetched "
        "and never reached the recovery",
        [("", folded.get("recovery_reread", 0))],
    )
    family("kvgate_worker_nodes", "gauge", "Nodes in its load table", [("", nodes)])
    family(
        "kvgate_worker_index_entries",
        "gauge",
        "(node, block) entries of its prefix index partitions",
        [("", entries)],
    )
    family(
        "kvgate_worker_table_records",
        "counter",
        "Changelog records written, by table (coalesced per commit interval)",
        [(f'{{table="{t}"}}', written.get(t, 0)) for t in TABLES],
    )
    family(
        "kvgate_worker_commit_seconds",
        "summary",
        "Time of the worker's commits, by phase: write (coalesced table records), send (until "
        "Kafka has them), commit (input offsets, the transaction with exactly-once)",
        [
            (f'_{part}{{phase="{p}"}}', commit_seconds.get(p, _NONE)[i])
            for p in PHASES
            for i, part in ((0, "sum"), (1, "count"))
        ],
    )
    family(
        "kvgate_worker_last_commit_seconds",
        "gauge",
        "Time of the worker's last commit, by phase",
        [(f'{{phase="{p}"}}', commit_seconds.get(p, _NONE)[2]) for p in PHASES],
    )
    family(
        "kvgate_worker_consumer_lag",
        "gauge",
        "Input messages not yet committed, by source",
        [(f'{{source="{src}"}}', lag.get(src, 0)) for src in SOURCES],
    )
    return "\n".join(lines) + "\n"
