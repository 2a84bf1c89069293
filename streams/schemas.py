"""The value model of every kvgate topic: versioned pydantic models, published as JSON Schema.

Every model carries ``schema_version``; a consumer rejects versions it does not know (the message
goes to the dead-letter topic). Fields are only ever added with defaults within one version, and a
consumer ignores fields it does not know: during a rolling upgrade a newer agent's heartbeat (a
field added since) is read by an older worker or router as the version it knows, instead of
being dead-lettered and its node lost.
Times are Unix seconds (float) unless the name says otherwise; block hashes are 63-bit integers
produced by :mod:`streams.blocks`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from streams.labels import check_labels

__all__ = [
    "CandidateScore",
    "ControlMessage",
    "DeadLetter",
    "Decision",
    "Heartbeat",
    "KvEventBatch",
    "LedgerEvent",
    "Message",
    "NodeRole",
    "Outcome",
]

NodeRole = Literal["mixed", "prefill", "decode"]
NodeId = str
AdapterName = Annotated[str, Field(min_length=1, max_length=200)]
INT63 = (1 << 63) - 1
BlockHash = Annotated[int, Field(ge=0, le=INT63)]


class Message(BaseModel):
    """Base of every topic value: frozen; fields it does not know are ignored (a newer
    producer's additions), every field it knows is validated."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class Heartbeat(Message):
    """Load and health of one engine, published by its agent every ``interval`` (500 ms)."""

    schema_version: Literal[1] = 1
    node_id: NodeId = Field(min_length=1, max_length=200)
    epoch: str = Field(min_length=1, description="agent incarnation; a new epoch resets seq")
    seq: int = Field(ge=0, description="per node and epoch, +1 per heartbeat")
    ts: float = Field(gt=0, description="when the agent read the engine")
    endpoint: str = Field(min_length=1, description="base URL of the engine's OpenAI API")
    pool: str = "default"
    model: str = Field(min_length=1)
    role: NodeRole = "mixed"
    model_source: str | None = Field(
        default=None,
        min_length=1,
        max_length=500,
        description="what the engine serves the model from (vLLM's /v1/models root: a path or a "
        "Hugging Face repository id); routers look its tokenizer up by it",
    )
    block_size: int = Field(gt=0)
    kv_blocks_total: int = Field(ge=0)
    kv_blocks_used: int = Field(ge=0)
    kv_blocks_admissible: int | None = Field(
        default=None,
        ge=0,
        description="KV blocks the largest request it could admit now may take: free plus "
        "evictable (cached, unreferenced) blocks, minus the engine's watermark (None: routers "
        "derive it from kv_blocks_total and kv_blocks_used)",
    )
    max_model_len: int | None = Field(
        default=None, gt=0, description="the engine's context limit (prompt + output), if known"
    )
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    prompt_tokens_per_s: float = Field(default=0.0, ge=0)
    generation_tokens_per_s: float = Field(default=0.0, ge=0)
    prefill_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        le=1e8,
        description="the engine's prefill rate (uncached prompt tokens per second) as its agent "
        "measured it on the idle engine (agents/probe.py); routers price a miss with it until "
        "their own requests taught them the rate (None: not measured)",
    )
    prefix_cache_hit_rate: float = Field(default=0.0, ge=0, le=1)
    healthy: bool = True
    draining: bool = False
    lease_s: float = Field(default=2.0, gt=0, description="node drops out if no beat for this long")
    kv_seq: int | None = Field(
        default=None,
        ge=0,
        description="seq of the last KV batch the agent published in this epoch (routers compare "
        "it with their index to know how far behind the index is)",
    )
    kv_index: Literal["events", "approximate", "degraded"] = Field(
        default="events",
        description="events: the node's KV events feed the prefix index; approximate: it has "
        "none (e.g. SGLang without KV events) and routers infer its cache from their own "
        "decisions; degraded: it should have them, but they do not arrive or do not translate "
        "(routers treat it as approximate)",
    )
    engine_restarts: int = Field(
        default=0,
        ge=0,
        description="engine restarts this agent incarnation saw (a new process start time, or "
        "the engine's KV event sequence starting over); each reset the node's blocks",
    )
    kv_events_lost: int = Field(
        default=0,
        ge=0,
        description="engine KV event batches this agent incarnation neither received nor got "
        "from the engine's replay socket (its periodic snapshot repairs the index)",
    )
    kv_events_undecodable: int = Field(
        default=0, ge=0, description="engine KV event batches and events it could not decode"
    )
    kv_blocks_untranslatable: int = Field(
        default=0,
        ge=0,
        description="stored blocks it could not chain (parent never seen, tokens missing)",
    )
    kv_blocks_skipped: int = Field(
        default=0,
        ge=0,
        description="stored blocks kept out of the index on purpose: offloaded to CPU/disk, "
        "non-prefix groups of hybrid models, unnamed LoRA adapters, multimodal and "
        "prompt-embedding hashes",
    )
    data_parallel_rank: int | None = Field(
        default=None,
        ge=0,
        le=1023,
        description="the engine's data-parallel rank this node is (one HTTP server, several "
        "engine cores with their own KV caches): routers send its requests with "
        "X-data-parallel-rank",
    )
    engine_started_at: float | None = Field(
        default=None,
        gt=0,
        description="when the engine process started (its process_start_time_seconds): a "
        "replica younger than the routers' slow-start window ramps up instead of taking full "
        "traffic with an empty cache",
    )
    kv_link_gbps: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description="the engine's KV transfer bandwidth to other engines (disaggregated "
        "prefill), Gbit/s; routers use their default when absent",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="the node's labels (zone, GPU type, …): requests and tenants may require "
        "or prefer them; routers prefer their own zone",
    )
    retention_hints: bool = Field(
        default=False,
        description="the engine keeps a finished request's KV for its agent_hint's "
        "cache_control.ttl: routers ask it to keep an agent session's prefix between turns",
    )
    kv_pull: bool = Field(
        default=False,
        description="the engine gives and takes a prefix's KV through its KV connector (a "
        "prefix sent with kv_transfer_params do_remote_decode is kept for another engine; a "
        "request with do_remote_prefill loads the blocks listed and computes the rest): "
        "routers may send a request to it and have it pull the prefix from its holder, or "
        "have another pull from it",
    )
    adapters: list[AdapterName] = Field(
        default_factory=list,
        max_length=256,
        description="LoRA adapters the engine serves (its /v1/models entries with a parent): a "
        "request whose model is one of them may run here, its blocks chained from the adapter",
    )

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)


class KvEventBatch(Message):
    """Cache deltas of one node since the previous batch, or a full snapshot of its cache.

    Apply in ``seq`` order per (node, epoch). ``cleared`` empties the node's entries before
    ``stored`` is applied. A ``snapshot`` replaces the node's entries with ``stored``.
    """

    schema_version: Literal[1] = 1
    node_id: NodeId = Field(min_length=1, max_length=200)
    epoch: str = Field(min_length=1, max_length=200)
    seq: int = Field(ge=0, le=INT63)
    ts: float = Field(gt=0)
    kind: Literal["delta", "snapshot"] = "delta"
    block_size: int = Field(gt=0)
    stored: list[BlockHash] = Field(default_factory=list)
    removed: list[BlockHash] = Field(default_factory=list)
    cleared: bool = False


class LedgerEvent(Message):
    """A reservation against the cluster KV budget (written by admission)."""

    schema_version: Literal[1, 2] = 1  # 2: a ``renew`` (version-1 consumers dead-letter it)
    reservation_id: str = Field(min_length=1)
    pool: str = "default"
    kind: Literal["reserve", "release", "expire", "renew"]
    kv_blocks: int = Field(ge=0)
    slots: int = Field(default=1, ge=0)
    tenant: str | None = Field(
        default=None, max_length=200, description="whose reservation (tenant quotas)"
    )
    router_id: str = Field(min_length=1)
    ts: float = Field(gt=0)
    lease_expires_at: float | None = None
    cause: str | None = Field(
        default=None,
        max_length=200,
        description="why a reservation was closed or restored by someone other than its router "
        "(lease ran out, reconciler)",
    )

    @model_validator(mode="after")
    def _renew(self) -> LedgerEvent:
        if self.kind == "renew" and (self.schema_version < 2 or self.lease_expires_at is None):
            raise ValueError("a renew is schema_version 2 and carries lease_expires_at")
        return self


class CandidateScore(Message):
    """One node as the routing policy saw it."""

    node_id: NodeId
    score: float
    hit_blocks: int = Field(ge=0)
    hit_fraction: float = Field(ge=0, le=1)
    kv_used_ratio: float = Field(ge=0)
    queue_len: float = Field(ge=0)
    healthy: bool
    components: dict[str, float] = Field(default_factory=dict)
    approximate_index: bool = Field(
        default=False,
        description="hit_blocks come from the router's own decisions, not the node's KV events",
    )


PassthroughKind = Literal["embeddings", "score", "rerank", "classify"]
# "models": GET /v1/models, the fleet's model list, answered by the router itself
EndpointKind = Literal["completions", "chat", "messages", "responses", "models"] | PassthroughKind


class Decision(Message):
    """Every admission and routing decision with the inputs that mattered."""

    schema_version: Literal[1] = 1
    request_id: str = Field(min_length=1)
    ts: float = Field(gt=0)
    router_id: str
    tenant: str = "default"
    priority: str = "normal"
    model: str
    pool: str = "default"
    session_id: str | None = None
    endpoint_kind: EndpointKind = Field(
        default="completions",
        description="the API asked; embeddings, score, rerank and classify pass through to the "
        "least loaded node of the model (policy 'passthrough': admitted for their input's KV, "
        "no token counts, no candidates); models is GET /v1/models, answered by the router "
        "(policy 'passthrough', no node)",
    )
    prompt_tokens: int = Field(ge=0)
    max_tokens: int = Field(ge=0)
    block_size: int = Field(gt=0)
    block_hashes: list[int] = Field(default_factory=list)
    approximate_tokens: bool = True
    admission: Literal["admitted", "queued", "rejected"] = "admitted"
    admission_reason: str = "ok"
    budget_usage: float | None = Field(
        default=None, description="cluster KV budget use if this request is admitted"
    )
    kv_blocks_estimate: int | None = Field(default=None, ge=0)
    output_tokens_estimate: int | None = Field(
        default=None, ge=0, description="output the KV reservation was sized for (learned)"
    )
    queue_wait_s: float | None = Field(
        default=None, ge=0, description="time spent in the admission queue (None: not queued)"
    )
    policy: str
    weights_version: int = 0
    chosen_node: NodeId | None
    reason: str
    prefill_node: str | None = Field(
        default=None,
        description="disaggregated: the node that computed the prompt's KV (chosen_node decodes)",
    )
    pull_node: str | None = Field(
        default=None,
        description="a pull: the node chosen_node loaded the prompt's first pull_blocks blocks "
        "of KV from (router/decision/pull.py)",
    )
    pull_blocks: int = Field(default=0, ge=0, le=1 << 24)
    candidates: list[CandidateScore] = Field(default_factory=list)
    index_age_s: float | None = None
    decision_us: float = Field(ge=0)
    client_request_id: str | None = Field(
        default=None,
        max_length=1024,
        description="the client's X-Request-Id, recorded as a label (request_id is kvgate's own)",
    )
    decision_seq: int = Field(
        default=0,
        ge=0,
        le=255,
        description="0: the request's decision; n: its n-th re-route, after n nodes failed it "
        "before any byte (request_id and decision_seq identify a decision)",
    )


class Outcome(Message):
    """What actually happened to a routed request."""

    schema_version: Literal[1] = 1
    request_id: str = Field(min_length=1)
    ts: float = Field(gt=0)
    router_id: str
    node_id: NodeId | None
    status: Literal["ok", "error", "cancelled", "rejected", "preempted"]
    http_status: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    cached_tokens: int | None = None
    reroutes: int = 0
    resumes: int = Field(
        default=0,
        ge=0,
        le=255,
        description="times its stream broke mid-answer and was continued on another node",
    )
    error: str | None = None


class ControlMessage(Message):
    """Operator and pipeline advice: pre-warm, policy weights, node drain, canary, scaling."""

    schema_version: Literal[1] = 1
    subject: str = Field(min_length=1)
    kind: Literal["prewarm", "weights", "drain", "undrain", "canary", "scale"]
    ts: float = Field(gt=0)
    payload: dict[str, Any] = Field(default_factory=dict)
    # HMAC-SHA256 of the message with key ``key_id`` (streams/controlauth.py); None: unsigned
    key_id: str | None = Field(default=None, max_length=200)
    signature: str | None = Field(default=None, max_length=128)


class DeadLetter(Message):
    """A message that failed validation, kept with the error so nothing is lost."""

    schema_version: Literal[1] = 1
    source_topic: str
    partition: int
    offset: int
    key: str | None
    value: str = Field(description="the original bytes, decoded as UTF-8 with replacement")
    error: str
    consumer: str
    ts: float
