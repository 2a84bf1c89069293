"""Every kvgate topic, declared once. Nothing else spells a topic name."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from streams.schemas import (
    ControlMessage,
    DeadLetter,
    Decision,
    Heartbeat,
    KvEventBatch,
    LedgerEvent,
    Outcome,
)

__all__ = [
    "ALL_TOPICS",
    "CONTROL",
    "DECISIONS",
    "DLQ",
    "HEARTBEATS",
    "KV_EVENTS",
    "LEDGER",
    "OUTCOMES",
    "TopicSpec",
]


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """A topic: its name within a namespace, what its key means and the model of its values."""

    suffix: str
    key: str
    value_model: type[BaseModel]
    cleanup_policy: str = "delete"
    retention_ms: int = 24 * 3600 * 1000
    partitions: int | None = None  # None: the namespace default

    def name(self, namespace: str) -> str:
        return f"{namespace}.{self.suffix}"

    def configs(self) -> dict[str, str]:
        if "delete" not in self.cleanup_policy:
            return {"cleanup.policy": self.cleanup_policy}
        return {"cleanup.policy": self.cleanup_policy, "retention.ms": str(self.retention_ms)}


HEARTBEATS = TopicSpec("heartbeats", "node id", Heartbeat, retention_ms=3600 * 1000)
KV_EVENTS = TopicSpec("kv-events", "node id", KvEventBatch, retention_ms=3600 * 1000)
LEDGER = TopicSpec("ledger", "pool", LedgerEvent)
DECISIONS = TopicSpec("decisions", "request id", Decision, retention_ms=7 * 24 * 3600 * 1000)
OUTCOMES = TopicSpec("outcomes", "request id", Outcome, retention_ms=7 * 24 * 3600 * 1000)
# compacted only: the latest weights per policy stay however old they are (pre-warm advice is
# followed by a tombstone of its subject, so compaction removes it)
CONTROL = TopicSpec("control", "subject", ControlMessage, cleanup_policy="compact")
DLQ = TopicSpec("dlq", "source key", DeadLetter, partitions=1, retention_ms=7 * 24 * 3600 * 1000)

ALL_TOPICS: tuple[TopicSpec, ...] = (
    HEARTBEATS,
    KV_EVENTS,
    LEDGER,
    DECISIONS,
    OUTCOMES,
    CONTROL,
    DLQ,
)
