"""The materialized tables, declared once: names, keys, and the changelog topics that hold them.

| table | key | value |
|---|---|---|
| ``load`` | node id | the node's latest :class:`Heartbeat` (JSON) |
| ``prefix_segments`` | ``<node id>|b<part>``, ``<node id>|d<slot>`` | a segment of the node's \
cached blocks with its KV cursor (:mod:`streams.segments`) |
| ``kv_ledger`` | reservation id | its ``reserve`` LedgerEvent (JSON) while open; tombstone |
"""

from __future__ import annotations

from dataclasses import dataclass

from streams.settings import KafkaSettings, WorkerSettings

__all__ = ["KV_LEDGER", "LOAD", "PREFIX_INDEX", "TableSpec", "app_id"]


@dataclass(frozen=True, slots=True)
class TableSpec:
    name: str
    key: str
    value: str

    def changelog(self, app: str) -> str:
        """Faust's changelog topic name for this table."""
        return f"{app}-{self.name}-changelog"


LOAD = TableSpec("load", "node id", "Heartbeat JSON")
PREFIX_INDEX = TableSpec("prefix_segments", "node|b<part> or node|d<slot>", "segment (binary)")
KV_LEDGER = TableSpec("kv_ledger", "reservation id", "reserve LedgerEvent JSON or tombstone")


def app_id(kafka: KafkaSettings, worker: WorkerSettings) -> str:
    return worker.app_id or f"{kafka.namespace}-streams"
