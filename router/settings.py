"""Router settings: where it listens, how it scores, what it replicates."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, IPvAnyNetwork, SecretStr

from router.decision.weights import (
    CostWeights,
    LaneSettings,
    OutlierSettings,
    SeedWeights,
    SlowStartSettings,
)
from streams.tokenization import TokenizerSpec

__all__ = ["RouterSettings"]


class RouterSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535, description="0: any free port")
    router_id: str | None = Field(default=None, description="default: host:port:pid")
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="router processes sharing the port (SO_REUSEPORT), each a whole router with "
        "its own replicas of the tables; >1 needs a fixed port (docs/operations.md)",
    )
    records_linger_ms: int = Field(
        default=25,
        ge=0,
        le=1000,
        description="the router's producer collects its decision, outcome and ledger records "
        "this long into one batch (fewer, larger produce requests: less CPU per request)",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        default="auto", description="auto: uvloop when installed, else asyncio's own"
    )
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
        "vllm_prefix_aware",
        "vllm_kv_aware",
        "kvgate",
    ] = "kvgate"
    policy_params: dict[str, float] = Field(
        default_factory=dict,
        description="a peer policy's own parameters (docs/baselines.md), e.g. dynamo_cost's "
        "overlap_score_credit; kvgate's weights live in `cost`",
    )
    weights: SeedWeights = SeedWeights()
    cost: CostWeights = CostWeights()
    prewarm: bool = Field(
        default=True, description="publish pre-warm advice for hot prefixes on kvgate.control"
    )
    cache_isolation: Literal["tenant", "off"] = Field(
        default="tenant",
        description="tenant: where API-key tenants are configured, each request carries a "
        "cache_salt derived from its tenant's cache group, so tenants never hit each other's "
        "cached prefixes (anonymous clients are one more group); off: clients' cache_salt "
        "passes unchanged and tenants share the engines' caches",
    )
    recent_prefill_ttl_s: float = Field(
        default=2.0,
        ge=0,
        description="remember prefixes this router had prefilled until indexed (0: off)",
    )
    fit_hold_s: float = Field(
        default=10.0,
        ge=0,
        description="a proxied request whose KV fits on no node now waits in the router up to "
        "this long (from its arrival) for a node to have room; then fit_overflow says what "
        "becomes of it (gateways and the endpoint picker are never held: 503 no_fit_now)",
    )
    fit_overflow: Literal["queue", "refuse"] = Field(
        default="queue",
        description="a proxied request still without room after fit_hold_s: queue, sent to the "
        "node nearest to room, whose engine queues it until its running requests free the "
        "blocks (as vLLM does; requests arriving later cannot take that room first); refuse, "
        "503 no_fit_now with Retry-After",
    )
    pending_prefixes: bool = Field(
        default=True,
        description="a prompt this router sent counts as a hit on its node until its first token "
        "(followers weigh queueing behind that prefill against computing the prompt elsewhere)",
    )
    default_max_tokens: int = Field(default=256, ge=1)
    tokenizers: dict[str, TokenizerSpec] = Field(
        default_factory=dict,
        description="model -> its tokenizer and chat template (engine-exact block hashes); "
        "models without one are looked up (tokenizer_discovery), else tokenized approximately",
    )
    tokenizer_discovery: bool = Field(
        default=True,
        description="find a model's tokenizer from what its engines serve it from (the "
        "heartbeat's model_source: a folder of tokenizer_dirs, or the Hugging Face cache for a "
        "repository id), loaded once per process and checked against the engine like a "
        "configured one",
    )
    tokenizer_dirs: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="folders holding model folders (the engines' models volume, e.g. /models): "
        "an engine serving .../<name> is looked up as <dir>/<name>/tokenizer.json",
    )
    offload_hit_value: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="what a prompt block a node holds only in an offloaded tier (CPU, disk) is "
        "worth in routing, as a share of a GPU hit: loaded, not computed, but not free",
    )
    tokenize_check_every: int = Field(
        default=100,
        ge=0,
        description="one request in this many of a model with a tokenizer is also tokenized by "
        "its engine (POST /tokenize) and compared (0: never)",
    )
    tokenize_check_min: int = Field(default=5, ge=1, description="checks before a verdict")
    tokenize_mismatch_share: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="above this share of mismatches the model's tokenization is approximate",
    )
    block_size: int = Field(default=16, gt=0, description="used until heartbeats tell otherwise")
    max_kv_used_ratio: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="kvgate: a node is skipped while the request's new prompt blocks would take "
        "its KV use over this share (1: while they do not fit); seed_score: while its KV use is "
        "at or over it",
    )
    max_queue: int = Field(
        default=64, ge=0, description="waiting requests above which a node is skipped"
    )
    objective_priorities: dict[str, Literal["high", "normal", "low"]] = Field(
        default_factory=dict,
        description="InferenceObjective name -> priority, for requests that name one in "
        "x-gateway-inference-objective (they may lower their tenant's priority, never raise it)",
    )
    objective_slo_classes: dict[str, str] = Field(
        default_factory=dict,
        description="InferenceObjective name -> SLO class (admission.slo_classes): a request "
        "naming the objective in x-gateway-inference-objective gets the class's TTFT target "
        "(held for it in the proxy, refused 429 deadline where no node can meet it — the "
        "endpoint picker's answer) and its priority, as X-Kvgate-Slo-Class would give them",
    )
    session_headers: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,64}$")]] = Field(
        default_factory=lambda: ["x-session-id", "session-id", "x-session-affinity"],
        max_length=16,
        description="headers an agent client names its session in, the first present wins over "
        "the body's session_id / metadata.session_id / metadata.user_id / user (the session "
        "home and hit accounting follow it); add a client's own header here",
    )
    forward_token_ids: bool = Field(
        default=True,
        description="a completion the router tokenized exactly goes to the engine as its token "
        "ids (vLLM's and SGLang's /v1/completions take them; the engine does not tokenize it "
        "again) once the engine's /tokenize has agreed with the router on the model every time "
        "it was asked; until then, and for chat and the agent APIs, as text",
    )
    session_retention: bool = Field(
        default=True,
        description="keep an agent session's prefix between its turns: learn each tenant's and "
        "model's inter-turn gap, hold the session's KV on its home for that long (a soft hold: "
        "nothing is refused for it) and ask engines that take retention hints to keep it",
    )
    session_hold_default_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="a paused session's hold before its tenant's and model's gaps are learned",
    )
    session_hold_max_s: float = Field(
        default=600.0, gt=0, le=3600, description="the longest hold a learned gap gives"
    )
    zone: str | None = Field(
        default=None, description="this router's zone: nodes labelled with it are preferred"
    )
    zone_label: str = Field(default="zone", description="the node label that names its zone")
    prefer_spill_kv_ratio: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="preferred nodes (labels, zone) are used while one has KV use below this",
    )
    prefer_spill_queue: int = Field(
        default=4, ge=0, description="… and at most this many requests waiting"
    )
    disaggregation: bool = Field(
        default=True,
        description="split requests over prefill and decode nodes when a model has both "
        "(router/decision/disagg.py)",
    )
    kv_link_gbps: float = Field(
        default=100.0, gt=0, description="KV transfer bandwidth of nodes that do not say theirs"
    )
    kv_bytes_per_token: int = Field(
        default=131_072,
        gt=0,
        description="KV bytes per prompt token for the transfer cost (Llama-3.1-8B, bf16)",
    )
    prefill_timeout_s: float = Field(
        default=60.0, gt=0, description="the prefill leg's limit; then the decode node computes"
    )
    pull_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description="a pull's leg limit (the holder's answer): then the chosen node computes the "
        "prompt — a pull is worth tens of milliseconds, a holder that takes longer is not waited "
        "for as long as a prefill leg",
    )
    pull_priority: int | None = Field(
        default=None,
        ge=-(1 << 31),
        le=(1 << 31) - 1,
        description="the priority a pull's leg asks its holder for (vLLM's request priority, "
        "lower first, for engines started with --scheduling-policy priority): the holder answers "
        "after the prompts it is computing, ahead of its queue; None: the leg waits in the "
        "holder's queue like any request, and the cost counts that queue (router/decision/pull.py)",
    )
    hold_poll_s: float = Field(
        default=0.05, gt=0, le=5, description="how often a held request looks again"
    )
    outlier: OutlierSettings = OutlierSettings()
    slow_start: SlowStartSettings = SlowStartSettings()
    lanes: LaneSettings = LaneSettings()  # long requests must not block short ones
    otlp_endpoint: str | None = Field(
        default=None,
        description="send OpenTelemetry spans (admission, routing, the proxied request) to this "
        "OTLP/HTTP traces endpoint, e.g. http://otel-collector:4318/v1/traces (needs the otel "
        "extra); off when unset",
    )
    epp_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="serve the Gateway API Inference Extension's endpoint picker (Envoy ext_proc "
        "gRPC) on this port too (needs the epp extra); off when unset",
    )
    epp_fallbacks: int = Field(
        default=2,
        ge=0,
        le=8,
        description="the endpoint picker names up to this many fallback endpoints after the "
        "one it picked (the next-best nodes the request can go to unchanged), in order: a "
        "gateway with retries tries them when the first fails, and tells which one served",
    )
    epp_transport: Literal["grpcio", "native"] = Field(
        default="native",
        description="the endpoint picker's gRPC server: kvgate's own HTTP/2 (router/h2.py; "
        "about half grpcio's CPU per request), or grpcio's asyncio server; plain text on both",
    )
    epp_max_streams: int = Field(
        default=1024,
        ge=1,
        description="ext_proc streams the endpoint picker serves at once; beyond, a new stream "
        "is refused (RESOURCE_EXHAUSTED) before it is read",
    )
    upstream_api_key: SecretStr | None = Field(
        default=None,
        description="the key engines were started with (vLLM --api-key): sent to them as "
        "Authorization: Bearer",
    )
    upstream_connect_timeout_s: float = Field(default=2.0, gt=0)
    upstream_idle_timeout_s: float = Field(default=300.0, gt=0)
    stale_heartbeat_s: float | None = Field(default=None, gt=0, description="default: lease")
    # --- who may call what (router/http/edge.py) ---
    gateway_keys: dict[str, str] = Field(
        default_factory=dict,
        description="gateway key -> gateway name: the callers of /v1/kvgate/route, /release and "
        "/renew (header X-Kvgate-Gateway-Key); without any, the gateway API is closed",
    )
    epp_keys: dict[str, str] = Field(
        default_factory=dict,
        description="key -> gateway name: the gateways whose ext_proc streams the endpoint "
        "picker serves (gRPC metadata x-kvgate-gateway-key); without any, every stream is served "
        "(and the router says so at start)",
    )
    admin_keys: dict[str, str] = Field(
        default_factory=dict,
        description="admin key -> name: Authorization for /v1/kvgate/decide and /v1/kvgate/state "
        "on the main listener",
    )
    admin_host: str = Field(default="127.0.0.1", description="the admin listener's address")
    admin_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="a second listener serving the admin endpoints, /metrics, /health and /ready "
        "without credentials (on admin_host, loopback by default); none when unset",
    )
    # --- limits before work ---
    max_body_bytes: int = Field(default=4 << 20, ge=1024, description="larger bodies get 413")
    body_timeout_s: float = Field(default=30.0, gt=0, description="body not read in time: 408")
    idle_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="a connection that has not sent a complete request's headers for this long "
        "is closed (idle keep-alive and slow headers alike)",
    )
    max_connections: int = Field(
        default=4096, ge=1, description="more concurrent connections are answered 503 and closed"
    )
    max_connections_per_client: int = Field(
        default=256,
        ge=1,
        description="connections one client address may hold on a listener; more are answered "
        "503 (behind an ingress or NAT, raise it or list the proxies in "
        "connection_share_exempt)",
    )
    connection_share_exempt: list[IPvAnyNetwork] = Field(
        default_factory=list,
        description="client networks the per-client share does not apply to (an ingress, a "
        "gateway), e.g. 10.0.0.0/8",
    )
    connection_headroom: int = Field(
        default=32,
        ge=0,
        description="past max_connections, a client address holding no connection still gets "
        "in, up to this many more: a liveness probe or a new tenant is not locked out by "
        "others' connections",
    )
    max_header_bytes: int = Field(default=8190, ge=256, description="per header line")
    max_headers: int = Field(default=64, ge=8)
    client_id_max_len: int = Field(
        default=128, ge=8, le=1024, description="X-Request-Id / Idempotency-Key labels"
    )
    stream_write_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="a streaming client that takes nothing for this long is cut off (its "
        "reservation released)",
    )
    stall_budget_s: float = Field(
        default=5.0,
        ge=0,
        description="a streaming client that takes nothing for this long is cut off (its "
        "engine request closed, its reservation released) while its pool's KV is contended "
        "(this router refused or queued a request for capacity within the last "
        "stream_write_timeout_s); otherwise after stream_write_timeout_s (0: always then)",
    )
    stream_send_buffer_bytes: int = Field(
        default=64 << 10,
        ge=4096,
        description="kernel send buffer and write buffer of a streaming client's connection: how "
        "much a client that stops reading can leave with the router before the write timeout "
        "starts counting",
    )
    max_stream_s: float = Field(
        default=3600.0, gt=0, description="longest a proxied request may run"
    )
    models_at_zero: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list,
        max_length=1000,
        description="models whose pools scale to zero: a request for one with no ready node "
        "waits for one (router.scale_wait_s) instead of a 404 or a 503",
    )
    scale_wait_s: float = Field(
        default=120.0,
        ge=0,
        description="longest a proxied request waits for a node of its model to be ready while "
        "one is starting (never past its SLO class's TTFT); then 503 scaling with Retry-After",
    )
    scale_up_s: float = Field(
        default=60.0,
        gt=0,
        description="a model's expected time from cold to a ready node before any start was "
        "seen (learned from each start afterwards)",
    )
    drain_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="streams still running on a node this long after it began to drain "
        "(kvgate drain, or its heartbeat says draining) go on from another node "
        "(router.stream_resumes), so that a drain or a scale-down does not wait for them",
    )
    stream_resumes: int = Field(
        default=2,
        ge=0,
        le=8,
        description="a chat or completion stream whose engine fails mid-answer (reset, gone, "
        "drained past its grace) is continued on another node with the prompt and the text "
        "sent so far, up to this many times; the client sees one stream (0: it gets the error "
        "event)",
    )
    refusal_records_per_s: float = Field(
        default=20.0,
        gt=0,
        description="requests refused before admission (bad input, credentials, unknown model) "
        "are recorded as decisions up to this rate; the rest are only counted",
    )
    # --- when Kafka stops delivering ---
    feed_stale_s: float = Field(
        default=1.5,
        gt=0,
        description="no heartbeat from any node for this long: the feed (Kafka) is down, not the "
        "nodes; the router serves degraded (keep it below the nodes' heartbeat lease, 2 s)",
    )
    degraded_view_s: float = Field(
        default=60.0,
        ge=0,
        description="how long a degraded router trusts its last-known view; after that it routes "
        "by its own load count over the last-known nodes that answer its probes",
    )
    probe_interval_s: float = Field(default=2.0, gt=0, description="engine probes when degraded")
