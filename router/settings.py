"""Router settings: where it listens, how it scores, what it replicates."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from streams.tokenization import TokenizerSpec

__all__ = ["CostWeights", "RouterSettings", "SeedWeights"]


class SeedWeights(BaseModel):
    """Weights of the seed score (DESIGN.md): higher score wins."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = 1
    hit: float = 0.5
    load: float = 0.3
    queue: float = 0.05
    unhealthy: float = 0.1
    slo: float = 0.1


class CostWeights(BaseModel):
    """The completion-cost model of the ``kvgate`` policy (defaults: the documented engine
    profile, docs/engine-model.md). ``version`` is recorded with every decision."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = 1
    prefill_tokens_per_s: float = Field(default=25_000.0, gt=0)
    step_base_s: float = Field(default=0.006, ge=0)
    step_per_seq_s: float = Field(default=0.00003, ge=0)
    step_per_context_token_s: float = Field(default=4.9e-8, ge=0)
    prefill_weight: float = Field(
        default=3.0, ge=0, description="weight of the uncached prefill (>1 values cache hits more)"
    )
    interference: float = Field(default=0.0, ge=0, description="weight of the stall on others")
    decode_horizon_tokens: int = Field(default=32, ge=0)
    kv_soft_limit: float = Field(default=0.85, ge=0, le=1)
    kv_pressure_s: float = Field(default=5.0, ge=0, description="cost per unit of KV over limit")
    prefill_ewma: float = Field(default=0.1, gt=0, le=1)
    load_ewma: float = Field(default=0.5, gt=0, le=1, description="smoothing of heartbeats")
    stale_grace_s: float = Field(default=0.5, ge=0, description="index lag that is normal")
    stale_tau_s: float = Field(default=1.0, gt=0, description="trust decay of a lagging index")
    session_affinity_s: float = Field(
        default=0.05, ge=0, description="bonus of a session's home node (0: no affinity)"
    )
    affinity_load_bound: float = Field(
        default=1.25, ge=1, description="home nodes above this × mean load are skipped"
    )


class RouterSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    router_id: str | None = Field(default=None, description="default: host:port:pid")
    policy: Literal[
        "seed_score",
        "random",
        "round_robin",
        "least_requests",
        "power_of_two",
        "consistent_hash",
        "sglang_cache_aware",
        "dynamo_cost",
        "llmd_weighted",
        "kvgate",
    ] = "kvgate"
    weights: SeedWeights = SeedWeights()
    cost: CostWeights = CostWeights()
    prewarm: bool = Field(
        default=True, description="publish pre-warm advice for hot prefixes on kvgate.control"
    )
    recent_prefill_ttl_s: float = Field(
        default=2.0,
        ge=0,
        description="remember prefixes this router had prefilled until indexed (0: off)",
    )
    default_max_tokens: int = Field(default=256, ge=1)
    tokenizers: dict[str, TokenizerSpec] = Field(
        default_factory=dict,
        description="model -> its tokenizer and chat template (engine-exact block hashes); "
        "models without one are tokenized approximately",
    )
    block_size: int = Field(default=16, gt=0, description="used until heartbeats tell otherwise")
    max_kv_used_ratio: float = Field(default=0.95, gt=0, le=1)
    max_queue: int = Field(
        default=64, ge=0, description="waiting requests above which a node is skipped"
    )
    upstream_connect_timeout_s: float = Field(default=2.0, gt=0)
    upstream_idle_timeout_s: float = Field(default=300.0, gt=0)
    stale_heartbeat_s: float | None = Field(default=None, gt=0, description="default: lease")
