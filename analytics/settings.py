"""ClickHouse and sink settings."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from streams.home import home

__all__ = ["ClickHouseSettings", "SinkSettings"]


class ClickHouseSettings(BaseModel):
    """``chdb`` (embedded, one process owns ``path``) or ``server`` (clickhouse-connect)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["chdb", "server"] = "chdb"
    path: str = Field(default_factory=lambda: str(home() / "clickhouse"))
    host: str = "127.0.0.1"
    port: int = Field(default=8123, ge=1, le=65535)
    username: str = "default"
    password: SecretStr = SecretStr("")
    database: str = "kvgate"
    secure: bool = False
    compress: bool = True


class SinkSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    group_id: str = "kvgate-sink"
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535, description="serve /metrics and /health here (off: unset)"
    )
    metrics_host: str = "127.0.0.1"
    batch_rows: int = Field(default=5000, gt=0)
    batch_interval_s: float = Field(default=1.0, gt=0)
    commit_every: int = Field(
        default=1,
        ge=1,
        description="commit Kafka offsets after this many inserted batches (fewer commits; a "
        "crash re-inserts up to this many batches, which the tables collapse)",
    )
    snapshot_interval_s: float = Field(
        default=10.0, gt=0, description="node snapshots: one heartbeat per node per interval"
    )
    identity_retention_days: int = Field(
        default=30,
        ge=0,
        le=30,
        description="days ClickHouse keeps the fields that can identify a user (session ids, "
        "the client's request ids); 0: never stored. Rows stay 30 days either way",
    )
