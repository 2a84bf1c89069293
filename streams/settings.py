"""Kafka connection settings shared by every component."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from streams.home import home

__all__ = ["KafkaSettings", "WorkerSettings"]


class KafkaSettings(BaseModel):
    """Where the brokers are and how topics are named.

    ``namespace`` prefixes every topic (``<namespace>.heartbeats``); tests use their own namespace
    so that they never share a topic.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str = "127.0.0.1:19092"
    namespace: str = Field(default="kvgate", pattern=r"^[A-Za-z0-9._-]+$")
    partitions: int = Field(default=4, ge=1)
    replication_factor: int = Field(default=1, ge=1)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None
    control_keys: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="key id -> secret: control messages (weights, drain, canary, pre-warm, "
        "scale) are signed with control_key_id and applied only when signed with one of these "
        "(streams/controlauth.py); empty: unsigned and unchecked. Set it before exposing Kafka",
    )
    control_key_id: str | None = Field(
        default=None, description="the key this process signs with (default: the first id)"
    )
    outbox_max_messages: int = Field(
        default=200_000,
        ge=1,
        description="messages a process holds while Kafka does not take them (an outage); more "
        "are dropped and counted, the caller never waits",
    )
    outbox_max_bytes: int = Field(default=256 << 20, ge=1 << 16, description="the same, in bytes")

    follow_fetch_wait_ms: int = Field(
        default=100,
        ge=1,
        le=5000,
        description="a following consumer (a router's replicas, its control and ledger readers) "
        "waits this long for follow_fetch_min_bytes before it takes what there is: the most "
        "the tables a router sees lag behind the topics on this account",
    )
    follow_fetch_min_bytes: int = Field(
        default=16 << 10,
        ge=1,
        description="what a following consumer's fetch collects before it returns early (1: "
        "every record at once — one fetch round trip per few records under load)",
    )

    def follow_options(self) -> dict[str, int]:
        """Fetch options of a consumer that follows topics as they grow."""
        return {
            "fetch_max_wait_ms": self.follow_fetch_wait_ms,
            "fetch_min_bytes": self.follow_fetch_min_bytes,
        }

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka clients (connection and security only)."""
        options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism is not None:
            options["sasl_mechanism"] = self.sasl_mechanism
            options["sasl_plain_username"] = self.sasl_username
            if self.sasl_password is not None:
                options["sasl_plain_password"] = self.sasl_password.get_secret_value()
        if self.ssl_cafile is not None:
            import ssl

            options["ssl_context"] = ssl.create_default_context(cafile=self.ssl_cafile)
        return options


class WorkerSettings(BaseModel):
    """The Faust worker that materializes the load table and the prefix index."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    app_id: str | None = Field(default=None, description="default: <namespace>-streams")
    # Input offsets and table writes commit in one Kafka transaction (faust-streaming 0.15.3 alone
    # commits without first draining the changelog records it buffered: the worker wraps its
    # commit to drain them, streams/faustcommit.py). False: at-least-once, which flushes before
    # every commit and relies on the idempotent folds; fresher tables for read_committed readers
    # (docs/benchmarks/pipeline.md compares the two).
    exactly_once: bool = True
    commit_interval_s: float = Field(default=1.0, gt=0)
    session_timeout_s: float = Field(default=10.0, gt=0)
    rebalance_timeout_s: float = Field(default=10.0, gt=0)
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    web_host: str = "127.0.0.1"
    web_port: int = Field(default=6066, ge=1, le=65535)
    data_dir: str = Field(default_factory=lambda: str(home() / "worker"))
    node_ttl_s: float = Field(default=300.0, gt=0, description="silent nodes are retired after")
    reap_interval_s: float = Field(default=10.0, gt=0)
    gc_young_threshold: int = Field(
        default=10_000,
        ge=700,
        description="allocations between the worker's young garbage collections (Python's "
        "default: 700). Each young collection moves survivors on, and every ten of them may "
        "start a full one, which walks every node's blocks: 0.2-0.4 s with a few thousand "
        "nodes, a pause on every table. 10,000 cut the worker's CPU at 1,000 nodes by a tenth "
        "and its block p99 by about 0.3 s (docs/benchmarks/pipeline.md)",
    )
