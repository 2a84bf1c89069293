"""The decision core's parameters: the cost model's and the seed policy's weights, the lane
rules, outlier ejection and slow start (``router.cost``, ``router.weights``, ``router.lanes``,
``router.outlier``, ``router.slow_start``; router/settings.py holds the rest)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "CostWeights",
    "LaneSettings",
    "OutlierSettings",
    "SeedWeights",
    "SlowStartSettings",
]


class LaneSettings(BaseModel):
    """Head-of-line isolation of long requests (router/decision/lanes.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    long_prompt_tokens: int = Field(
        default=8192, ge=1, description="an uncached prompt this long is a long request"
    )
    long_output_tokens: int = Field(
        default=1024, ge=1, description="an expected output this long is a long request"
    )
    max_long_kv_share: float = Field(
        default=0.5, gt=0, le=1, description="of a node's KV blocks, for long requests"
    )
    hold: bool = Field(
        default=True, description="requests wait in the router while the engines are queued"
    )
    hold_queue_s: float = Field(
        default=1.0, ge=0, description="… more than this much prefill queued on the best node"
    )
    long_yield_s: float = Field(
        default=10.0, ge=0, description="a long request yields to short ones this much younger"
    )
    hold_max_s: float = Field(default=60.0, ge=0, description="a request waits at most this")
    max_waiting: int = Field(
        default=10_000, ge=0, description="requests the router's queue holds (then: sent at once)"
    )
    lane: bool = Field(default=False, description="prefill long prompts on a lane of nodes")
    lane_floor: float = Field(default=0.125, ge=0, le=1, description="of the pool's nodes")
    lane_ceiling: float = Field(default=0.5, ge=0, le=1, description="of the pool's nodes")
    lane_headroom: float = Field(
        default=1.5, ge=1, description="lane size = long prompts' share of prefill work × this"
    )
    lane_window_s: float = Field(
        default=60.0, gt=0, description="half-life of the prefill work the lane is sized on"
    )
    spill_queue_s: float = Field(
        default=0.5,
        ge=0,
        description="short requests use lane nodes when every other node has this much "
        "prefill queued",
    )


class SeedWeights(BaseModel):
    """Weights of the seed score (DESIGN.md): higher score wins. Bounded: a weights message
    outside the bounds is refused as a whole."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    version: int = Field(default=1, ge=0)
    hit: float = Field(default=0.5, ge=0, le=100)
    load: float = Field(default=0.3, ge=0, le=100)
    queue: float = Field(default=0.05, ge=0, le=100)
    unhealthy: float = Field(default=0.1, ge=0, le=100)
    slo: float = Field(default=0.1, ge=0, le=100)


class CostWeights(BaseModel):
    """The completion-cost model of the ``kvgate`` policy (defaults: the documented engine
    profile, docs/engine-model.md). ``version`` is recorded with every decision."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    version: int = Field(default=1, ge=0)
    prefill_tokens_per_s: float = Field(default=25_000.0, gt=0, le=1e8)
    step_base_s: float = Field(default=0.00845, ge=0, le=10)
    step_per_seq_s: float = Field(default=0.00003, ge=0, le=1)
    step_per_context_token_s: float = Field(default=5.59e-8, ge=0, le=1e-3)
    prefill_weight: float = Field(
        default=3.0,
        ge=0,
        le=100,
        description="weight of the uncached prefill (>1 values cache hits more)",
    )
    interference: float = Field(
        default=0.0, ge=0, le=100, description="weight of the stall on others"
    )
    congestion: float = Field(
        default=1.0,
        ge=0,
        le=100,
        description="weight of the delay a prefill imposes on the requests queued behind it "
        "(× the node's waiting requests)",
    )
    decode_horizon_tokens: int = Field(default=32, ge=0, le=100_000)
    kv_soft_limit: float = Field(default=0.85, ge=0, le=1)
    kv_pressure_s: float = Field(
        default=5.0, ge=0, le=3600, description="cost per unit of KV over limit"
    )
    prefill_ewma: float = Field(default=0.1, gt=0, le=1)
    load_ewma: float = Field(default=0.5, gt=0, le=1, description="smoothing of heartbeats")
    stale_grace_s: float = Field(default=0.5, ge=0, le=600, description="index lag that is normal")
    stale_tau_s: float = Field(
        default=1.0, gt=0, le=3600, description="trust decay of a lagging index"
    )
    session_affinity_s: float = Field(
        default=0.1, ge=0, le=600, description="bonus of a session's home node (0: no affinity)"
    )
    affinity_load_bound: float = Field(
        default=1.25, ge=1, le=100, description="home nodes above this × mean load are skipped"
    )
    resident_share: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="a session whose prompt needs this share of a node's KV is resident: placed "
        "by the resident contexts and kept on its holder (router/decision/residency.py; 0: off)",
    )
    resident_tokens: int = Field(
        default=48_000,
        ge=0,
        le=10_000_000,
        description="a session whose prompt has this many tokens is resident whatever its share "
        "of a node's KV: placed by the shared prefix, such contexts pile onto its holders "
        "(router/decision/residency.py; 0: the share alone)",
    )
    resident_window_s: float = Field(
        default=120.0, gt=0, le=86_400, description="a resident session counts for this long"
    )
    resident_hold: float = Field(
        default=0.3, gt=0, le=1, description="share of a resident turn's prompt a holder keeps"
    )
    resident_fill: float = Field(
        default=1.0,
        ge=0,
        le=4,
        description="a resident session is placed on a node whose resident contexts and its "
        "prompt stay within this share of the node's KV; where none has room it overflows to "
        "the node most committed (router/decision/residency.py; 0: the fewest resident tokens, "
        "no room asked)",
    )
    resident_overflow_wait_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="a resident session that overflows goes to the most committed node whose "
        "queued prefill clears within this, and a later turn leaves an overflow node whose queue "
        "is longer where it starts `resident_move_gain` × sooner (router/decision/residency.py; "
        "0: the most committed node whatever its queue, and no turn leaves it)",
    )
    resident_move_gain: float = Field(
        default=1.5,
        ge=1,
        le=100,
        description="a turn leaves an overflow node only where it would start this many times "
        "sooner (router/decision/residency.py)",
    )
    kv_pull: bool = Field(
        default=True,
        description="price loading a prefix's KV from the node holding it, where both engines "
        "can (router/decision/pull.py; false: compute it or go to its holder)",
    )
    pull_overhead_s: float = Field(
        default=0.02,
        ge=0,
        le=60,
        description="a pull's fixed time before the KV moves (the holder's answer, the handshake)",
    )


class OutlierSettings(BaseModel):
    """Outlier ejection on the outcomes the router sees (Envoy's outlier detection; names and
    defaults follow its ``OutlierDetection`` message, router/decision/outlier.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    consecutive_errors: int = Field(
        default=5, ge=1, description="5xx, timeouts and connection errors in a row that eject"
    )
    interval_s: float = Field(default=10.0, gt=0, description="success-rate analysis interval")
    base_ejection_time_s: float = Field(default=30.0, gt=0, description="× ejections so far")
    max_ejection_time_s: float = Field(default=300.0, gt=0)
    max_ejection_percent: float = Field(
        default=10.0, ge=0, le=100, description="of the nodes at once (at least one)"
    )
    success_rate_minimum_hosts: int = Field(default=5, ge=1)
    success_rate_request_volume: int = Field(default=100, ge=1, description="per interval")
    success_rate_stdev_factor: float = Field(default=1.9, gt=0)
    probe_successes: int = Field(
        default=1, ge=1, description="successes in a row before a probing node is trusted again"
    )
    probe_timeout_s: float = Field(
        default=60.0, gt=0, description="a probe with no outcome after this long failed"
    )


class SlowStartSettings(BaseModel):
    """A new replica's ramp-up (Envoy's ``slow_start_config``): offered a request with
    probability max(min_weight, (age / window_s) ** (1 / aggression)) while younger than
    window_s."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    window_s: float = Field(default=60.0, ge=0, description="0: no slow start")
    aggression: float = Field(default=1.0, gt=0)
    min_weight: float = Field(default=0.1, gt=0, le=1)
