"""What a simulated run is given and gives back: the cluster's configuration
(:class:`SimConfig`), the operations on its fleet and the client retry model, the finished
requests (:class:`Done`) and the autoscaler's decisions (:class:`ScalePoint`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from admission.settings import AdmissionSettings
from agents.profile import EngineProfile
from analytics.autoscale import AutoscaleSettings
from analytics.sim.traces import TraceRequest
from router.decision.placement import FREE, Placement
from router.decision.weights import LaneSettings, OutlierSettings, SlowStartSettings
from router.settings import RouterSettings

__all__ = [
    "MODEL",
    "Done",
    "FleetOp",
    "RetryModel",
    "ScalePoint",
    "SimConfig",
    "acting_on",
    "node_names",
    "node_profile",
    "with_router",
]

MODEL = "sim"


@dataclass(frozen=True, slots=True)
class SimConfig:
    nodes: int = 16
    profile: EngineProfile = field(default_factory=EngineProfile)
    heartbeat_interval_s: float = 0.5
    index_lag_s: float = 0.15  # agent flush (100 ms) + Kafka + fold
    seed: int = 0
    fast_forward: bool = True  # steady decoding as one event per run (exact, see DecodeRun)
    # act on hot-prefix advice (router/decision/hotprefix.py) like the live agents
    prewarm: bool = False
    prewarm_delay_s: float = 0.2  # advice on kvgate.control → agent → engine
    admission: AdmissionSettings | None = None  # admission control in front of routing
    retries: RetryModel | None = None  # refused clients retry (None: a refusal is final)
    storm_guard: bool = False  # the retry-storm guard in front of admission
    # the router remembers its completed prefills (router/decision/recent.py)
    recent_prefill_ttl_s: float = 0.0
    # prompts being prefilled count as hits on their node (router/decision/recent.py)
    pending_prefixes: bool = False
    # a request whose KV fits nowhere now waits for room (router.fit_hold_s; 0: refused at once)
    fit_hold_s: float = RouterSettings.model_fields["fit_hold_s"].default
    # … then the engine's queue on the node nearest to room (router.fit_overflow; False: 503)
    fit_queue: bool = RouterSettings.model_fields["fit_overflow"].default == "queue"
    # the agents measured the engines' prefill rate and heartbeats carry it (agents/probe.py,
    # agent.prefill_probe): the profile's rate; off: routers know only what they learn
    prefill_probe: bool = True
    node_ids: tuple[str, ...] = ()  # the nodes' names (default node-00, node-01, ...)
    # the live router's fleet rules (router/decision/fleet.py): outlier ejection, slow start, and
    # the operations on the fleet over time (drain, join, leave, canary)
    outlier: OutlierSettings = field(default_factory=lambda: OutlierSettings(enabled=False))
    slow_start: SlowStartSettings = field(default_factory=lambda: SlowStartSettings(window_s=0))
    ops: tuple[FleetOp, ...] = ()
    faults: tuple[tuple[str, float], ...] = ()  # (node, share of its requests answered with 500)
    fault_latency_s: float = 0.005  # how fast a broken engine answers
    node_labels: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()  # (node, labels)
    roles: tuple[tuple[str, str], ...] = ()  # (node, prefill | decode); others are mixed
    kv_link_gbps: float = 100.0  # KV transfer between engines (disaggregated prefill)
    disaggregation: bool = True  # split requests over prefill and decode nodes when both exist
    kv_pull: bool = False  # engines give and take a prefix's KV (router/decision/pull.py)
    pull_first: bool = False  # a pull's leg goes ahead of the holder's queue (pull_priority)
    # agent sessions' KV kept on their node between turns for the learned gap
    # (router.session_retention: router/decision/turngap.py, the engines' retention hints)
    session_retention: bool = False
    session_hold_default_s: float = RouterSettings.model_fields["session_hold_default_s"].default
    session_hold_max_s: float = RouterSettings.model_fields["session_hold_max_s"].default
    placement: Placement = FREE  # every request's required and preferred labels
    # the router's candidate cap (router.max_queue): nodes with more waiting are skipped
    max_queue: int = RouterSettings.model_fields["max_queue"].default
    lanes: LaneSettings | None = (
        None  # head-of-line isolation of long requests (router/decision/lanes.py)
    )
    # a closed-loop autoscaler (analytics/autoscale.py): ``nodes`` at the start, then what it
    # asks for; a new node serves after its lead time and starts cold
    autoscaler: AutoscaleSettings | None = None
    # a model with no ready node while one is coming: requests wait this long at most
    # (router.scale_wait_s, never past their TTFT), then 503 scaling (analytics/sim/scaleroom.py)
    scale_wait_s: float = RouterSettings.model_fields["scale_wait_s"].default
    scale_up_s: float = RouterSettings.model_fields["scale_up_s"].default  # until one is seen


@dataclass(frozen=True, slots=True)
class ScalePoint:
    """One autoscaler decision: the desired count, the nodes serving, the nodes paid for
    (serving, loading their model, or draining), the forecast rate (predictive)."""

    at_s: float
    desired: int
    serving: int
    provisioned: int
    arrivals_rps: float


@dataclass(frozen=True, slots=True)
class FleetOp:
    """An operation on the simulated fleet at ``at_s``: ``drain``/``undrain`` a node, ``join``
    (a node listed only here is absent until it joins, then starts cold, in slow start) or
    ``leave`` (no new requests; what runs there finishes), ``canary`` (``nodes`` take
    ``share`` of the requests; share 0 ends it), ``heal`` (its faults stop)."""

    at_s: float
    kind: Literal["drain", "undrain", "join", "leave", "canary", "heal"]
    node: str = ""
    nodes: tuple[str, ...] = ()
    share: float = 0.0


def node_names(cfg: SimConfig) -> list[str]:
    return list(cfg.node_ids) if cfg.node_ids else [f"node-{i:02d}" for i in range(cfg.nodes)]


@dataclass(frozen=True, slots=True)
class RetryModel:
    """How refused clients come back: after Retry-After, up to ``max_attempts``; the clients in
    ``storm_clients`` ignore it and retry after ``storm_delay_s``, up to ``storm_max_attempts``."""

    max_attempts: int = 4
    storm_clients: frozenset[str] = frozenset()
    storm_delay_s: float = 0.05
    storm_max_attempts: int = 40


@dataclass(slots=True)
class Done:
    """One finished request."""

    request: TraceRequest
    node: str
    reason: str
    hit_blocks_seen: int  # what the router believed the node had
    cached_tokens: int  # what the engine actually reused
    first_token_s: float
    finish_s: float
    queue_wait_s: float = 0.0  # time in the admission queue (included in TTFT)


def with_router(cfg: SimConfig, router: RouterSettings) -> SimConfig:
    """``cfg`` with what the kvgate router does beside routing, as ``router`` configures it:
    pre-warming hot prefixes, remembering its recent prefills, counting pending ones."""
    return replace(
        cfg,
        prewarm=router.prewarm,
        recent_prefill_ttl_s=router.recent_prefill_ttl_s,
        pending_prefixes=router.pending_prefixes,
        fit_hold_s=router.fit_hold_s,
        fit_queue=router.fit_overflow == "queue",
        pull_first=router.pull_priority is not None,
        session_retention=router.session_retention,
        session_hold_default_s=router.session_hold_default_s,
        session_hold_max_s=router.session_hold_max_s,
    )


def acting_on(cfg: SimConfig, router: RouterSettings) -> SimConfig:
    """``cfg`` with the kvgate system acting on the router's own advice (:func:`with_router`;
    other policies have none of it)."""
    return with_router(cfg, router) if router.policy == "kvgate" else cfg


def node_profile(cfg: SimConfig, block_size: int) -> EngineProfile:
    """The engine profile at the trace's block size, keeping the profile's KV memory."""
    profile = (
        cfg.profile.model_copy(update={"block_size": block_size})
        if block_size != cfg.profile.block_size
        else cfg.profile
    )
    if block_size != cfg.profile.block_size and cfg.profile.num_gpu_blocks_override is None:
        profile = profile.model_copy(
            update={
                "num_gpu_blocks_override": max(
                    1, cfg.profile.num_gpu_blocks * cfg.profile.block_size // block_size
                )
            }
        )
    return profile
