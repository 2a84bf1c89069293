"""Admission control settings: tenants and priorities, watermarks, cost estimate, reservations."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from streams.labels import check_labels

__all__ = [
    "DEFAULT_SLO_CLASSES",
    "AdmissionSettings",
    "Priority",
    "RedisSettings",
    "SloClass",
    "Tenant",
]

Priority = Literal["high", "normal", "low"]


class RedisSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = "redis://127.0.0.1:16379/0"
    password: SecretStr | None = None
    socket_timeout_s: float = Field(default=1.0, gt=0)
    max_connections: int = Field(
        default=64,
        ge=1,
        description="connections a router keeps to Redis; a request finding them all busy waits "
        "for one up to pool_timeout_s (then: 503 store unavailable), it is never refused at once",
    )
    pool_timeout_s: float = Field(default=1.0, gt=0)
    sentinels: list[str] = Field(
        default_factory=list,
        description="host:port of Redis Sentinels: the primary of sentinel_service is found "
        "through them and followed when they fail over (url then gives only the database and "
        "password)",
    )
    sentinel_service: str = Field(default="kvgate", description="the Sentinels' master name")
    sentinel_password: SecretStr | None = None

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, v: list[str]) -> list[str]:
        for item in v:
            host, _, port = item.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"sentinel {item!r}: expected host:port")
        return v


class Tenant(BaseModel):
    """A client, known by its API key; its priority comes from here (a request may lower its
    own with a criticality or InferenceObjective header, never raise it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=200, pattern=r"^[^|]+$")
    priority: Priority = "normal"
    weight: float = Field(
        default=1.0, gt=0, description="share of a contended pool relative to other tenants"
    )
    max_concurrency: int | None = Field(
        default=None, ge=1, description="most requests in flight at once (all routers)"
    )
    max_kv_share: float | None = Field(
        default=None, gt=0, le=1, description="most of a pool's KV budget held at once"
    )
    slo_class: str | None = Field(
        default=None, description="its requests' SLO class (admission.slo_classes)"
    )
    slo_classes: list[str] = Field(
        default_factory=list,
        description="classes its requests may ask for with X-Kvgate-Slo-Class (default: any "
        "whose priority is not above the tenant's)",
    )
    require_labels: dict[str, str] = Field(
        default_factory=dict, description="its requests run only on nodes with these labels"
    )
    prefer_labels: dict[str, str] = Field(
        default_factory=dict, description="its requests prefer nodes with these labels"
    )
    requests_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="most requests taken per minute (all routers; admission.rate_window_s)",
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="most tokens per minute (all routers): a request counts its prompt when "
        "taken, its prompt and output once it ended",
    )
    engine_priority: bool = Field(
        default=False,
        description="may set the body's `priority` (the engine's own priority scheduling); "
        "otherwise kvgate removes it before the engine sees it",
    )
    cache_group: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="tenants with the same cache group share the engines' cached prefixes "
        "(default: the tenant's name, a group of its own; router.cache_isolation)",
    )

    @field_validator("require_labels", "prefer_labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)


class SloClass(BaseModel):
    """A service level a request is held to: its TTFT and TPOT targets, the priority it runs
    at, and how heavily routing weighs queueing for it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_s: float = Field(gt=0, description="time to first token target")
    tpot_s: float = Field(gt=0, description="time per output token target")
    priority: Priority = "normal"
    queue_weight: float = Field(
        default=1.0, ge=0, le=100, description="× the queueing term of the routing cost"
    )
    hold_queue_s: float | None = Field(
        default=None,
        ge=0,
        description="an admitted request of this class waits in the router while its best "
        "node has more than this much work queued ahead of it (None: never held): loose "
        "classes fill the engines only as far as tight classes keep their TTFT",
    )


DEFAULT_SLO_CLASSES = {
    "interactive": SloClass(ttft_s=2.0, tpot_s=0.1, priority="high", queue_weight=3.0),
    "standard": SloClass(ttft_s=10.0, tpot_s=0.2, priority="normal"),
    "batch": SloClass(
        ttft_s=600.0, tpot_s=1.0, priority="normal", queue_weight=0.3, hold_queue_s=0.1
    ),
}

_QUEUE_TIMEOUTS: dict[Priority, float] = {"high": 30.0, "normal": 10.0, "low": 0.0}
_SHEDDABLE: tuple[Priority, ...] = ("low",)


class AdmissionSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    backend: Literal["inproc", "redis"] = Field(
        default="inproc", description="inproc: one router; redis: several routers share a budget"
    )
    release_linger_ms: float = Field(
        default=5.0,
        ge=0,
        le=100,
        description="with backend=redis, a reservation's release waits up to this long to go "
        "to Redis with the next reservation (one round trip instead of two; the budget comes "
        "back that much later; 0: at once)",
    )
    yellow_watermark: float = Field(default=0.8, gt=0, le=1)
    red_watermark: float = Field(default=0.9, gt=0, le=1)
    safety_factor: float = Field(default=1.1, ge=1)
    expected_output_cap: int = Field(
        default=512, ge=1, description="max_tokens above this count as this much (until learned)"
    )
    learn_output: bool = Field(
        default=True, description="learn expected output per tenant and model from outcomes"
    )
    output_quantile: float = Field(default=0.9, gt=0, le=1, description="of learned outputs")
    output_min_samples: int = Field(default=20, ge=1, description="before the estimate is used")
    queue_enabled: bool = Field(default=True, description="above red, normal priority waits")
    queue_timeout_s: dict[Priority, float] = Field(
        default_factory=lambda: dict(_QUEUE_TIMEOUTS),
        description="longest wait in the queue per priority (0: never queues)",
    )
    queue_max_entries: int = Field(default=1000, ge=0, description="per priority, per router")
    resume_overtake_s: float = Field(
        default=2.0,
        ge=0,
        le=60,
        description="an agent session's turn arriving while its KV is held (router/flow/"
        "sessions.py) queues ahead of its class's other requests, but never ahead of one that "
        "has waited this long (a bound on how long a new request can be passed over; 0: off)",
    )
    queue_aging_s: float = Field(
        default=5.0,
        ge=0,
        le=600,
        description="a queued request counts as one priority higher for every this many seconds "
        "it has waited (its place in the queue and the watermark it may fill to): a lower class "
        "is never starved by a higher one under sustained saturation (0: strict priority)",
    )
    preemption: bool = Field(
        default=True,
        description="when a request of a higher priority would miss its deadline — waiting in "
        "the admission queue, or behind the prefill queued on its best node — streamed "
        "requests of preempt_priorities this router is serving that have not produced their "
        "first token are ended (503 preempted, with Retry-After) to make room or time for it",
    )
    preempt_priorities: list[Priority] = Field(
        default_factory=lambda: list(_SHEDDABLE),
        description="the sheddable priorities: only their requests are preempted, and only for "
        "a request of a higher priority",
    )
    queue_poll_s: float = Field(default=0.05, gt=0, description="queue re-check interval")
    min_healthy_share: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="below this share of the healthy nodes' KV capacity with a queue under "
        "router.max_queue, requests get 503 (backed up); below this share of the known KV "
        "capacity healthy, the fleet is degraded: served by the nodes left, admitted against "
        "their budget (admission sheds the rest by priority, with Retry-After), and counted",
    )
    store_down_share: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="while the shared reservation store (Redis) cannot be reached, a router "
        "admits up to this share of the budget on its own (what it already holds counted), "
        "and tells the store once it answers again; unset: 1 / the routers that used the "
        "store in the last 10 minutes, so that together they stay within the budget; 0: "
        "refuse meanwhile (503 store_unavailable)",
    )
    rate_window_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="tenants' requests_per_minute and tokens_per_minute hold over every window "
        "this long (scaled to it)",
    )
    slots_per_node: int = Field(default=256, ge=1)
    lease_s: float = Field(default=600.0, gt=0, description="a reservation expires on its own")
    sweep_interval_s: float = Field(default=5.0, gt=0, description="how often leases are checked")
    lease_renew_at: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="a request still being served renews its lease once less than this fraction "
        "of lease_s is left",
    )
    reconcile_interval_s: float = Field(
        default=1.0, gt=0, description="how often the ledger, the store and the nodes are compared"
    )
    reconcile_grace_s: float = Field(
        default=10.0,
        gt=0,
        description="how long a difference between ledger and store may last before it is fixed",
    )
    reconcile_standby_s: float = Field(
        default=30.0,
        gt=0,
        description="a router follows the ledger while it reconciles or nobody does, and this "
        "long after; then it stops (only the reconciling router reads every router's events)",
    )
    min_retry_after_s: float = Field(default=1.0, gt=0)
    max_retry_after_s: float = Field(default=60.0, gt=0)
    retry_guard: bool = True
    retry_guard_window_s: float = Field(default=60.0, gt=0)
    retry_guard_max_s: float = Field(default=600.0, gt=0, description="longest penalty")
    retry_guard_new_requests: Literal["off", "anonymous", "all"] = Field(
        default="anonymous",
        description="whose new requests during their Retry-After count as a storm: anonymous "
        "clients (per address) by default; 'all' holds API-key tenants to it too (a busy "
        "tenant has many users, whom its quotas and fair share already bound)",
    )
    retry_guard_client_burst: int = Field(
        default=20,
        ge=0,
        description="new requests a refused client (a tenant, or an anonymous address) may send "
        "before its Retry-After passes; more are refused as a retry storm",
    )
    fair_share: bool = Field(
        default=True,
        description="above the yellow watermark, a tenant already holding reservations gets no "
        "more than its weighted share of the pool (weight / sum of the weights of the tenants "
        "holding reservations); below it, idle capacity is anyone's",
    )
    fair_share_window_s: float = Field(
        default=10.0, gt=0, description="a tenant that asked this recently counts for fair share"
    )
    slo_classes: dict[str, SloClass] = Field(
        default_factory=lambda: dict(DEFAULT_SLO_CLASSES),
        description="service levels by name: a tenant's slo_class, or X-Kvgate-Slo-Class",
    )
    deadline_refusal: bool = Field(
        default=True,
        description="refuse at once (429 deadline, with Retry-After) a request whose SLO "
        "class's TTFT the best node's expected queue and prefill would miss",
    )
    require_api_key: bool = False
    tenants: dict[str, Tenant] = Field(default_factory=dict, description="API key -> tenant")
    anonymous: Tenant = Tenant(name="anonymous", priority="normal")

    @model_validator(mode="after")
    def _watermarks_rise(self) -> AdmissionSettings:
        if not self.yellow_watermark < self.red_watermark:
            raise ValueError("yellow_watermark must be below red_watermark")
        if self.min_retry_after_s > self.max_retry_after_s:
            raise ValueError("min_retry_after_s must not exceed max_retry_after_s")
        for t in [*self.tenants.values(), self.anonymous]:
            for name in [t.slo_class, *t.slo_classes]:
                if name is not None and name not in self.slo_classes:
                    raise ValueError(f"tenant {t.name}: unknown SLO class {name!r}")
        return self
