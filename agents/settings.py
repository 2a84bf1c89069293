"""Settings of the simulated engine and of the node agent."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from agents.profile import EngineProfile
from streams.labels import check_labels
from streams.tokenization import TokenizerSpec

__all__ = ["AgentSettings", "EngineSettings"]


class EngineSettings(BaseModel):
    """One simulated engine replica (speaks vLLM's HTTP, metrics and KV-event formats)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=1, le=65535)
    served_model_name: str = "llama-3.1-8b"
    kv_events_endpoint: str | None = "tcp://127.0.0.1:5557"
    kv_events_replay_endpoint: str | None = None  # vLLM default: no replay socket
    kv_events_connect: bool = Field(
        default=False,
        description="dial out to kv_events_endpoint (a collector that binds, as in llm-d) "
        "instead of binding it",
    )
    kv_events_shape: Literal["map", "array"] = Field(
        default="map",
        description="map: events as vLLM >= 0.26 writes them (named fields); array: the "
        "positional events of earlier releases",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="as vLLM's --api-key: /v1 endpoints want Authorization: Bearer <key>",
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="engine cores behind the one HTTP server, each with its own KV cache and its "
        "KV events on the endpoint's port + rank (vLLM's --data-parallel-size); a request goes "
        "to the rank in its X-data-parallel-rank header, else to the least loaded",
    )
    lora_modules: list[str] = Field(
        default_factory=list,
        description="LoRA adapters it serves, as vLLM's --lora-modules: name=path; a request "
        "whose model is an adapter's name runs with it (its blocks are hashed with it)",
    )
    default_max_tokens: int = Field(default=256, ge=1)
    metrics_format: Literal["vllm", "sglang"] = Field(
        default="vllm", description="whose /metrics names to serve (the agent reads both)"
    )
    tokenizer: TokenizerSpec | None = Field(
        default=None, description="tokenize like this model (default: 4-byte text chunks)"
    )
    kv_transfer: bool = Field(
        default=False,
        description="as vLLM with a KV connector (NixlConnector, kv_both): a request with "
        "kv_transfer_params do_remote_decode prefills and answers with the params a decode "
        "engine needs; one with do_remote_prefill receives the prompt's KV instead of "
        "computing it",
    )
    kv_link_gbps: float = Field(
        default=100.0, gt=0, description="KV transfer bandwidth to other engines (Gbit/s)"
    )
    fault: Literal["none", "error", "hang"] = Field(
        default="none",
        description="a broken engine whose /metrics and /health look fine: error answers "
        "generation requests with 500, hang accepts them and never answers (fault tests; "
        "POST /kvgate/fault changes it at runtime)",
    )
    fault_share: float = Field(default=1.0, ge=0, le=1, description="of requests that fail")
    seed: int = 0
    profile: EngineProfile = EngineProfile()

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, v: list[str]) -> list[str]:
        for item in v:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"a LoRA module is name=path, not {item!r}")
        return v

    @property
    def adapters(self) -> dict[str, str]:
        """Adapter name -> path, in the order given (vLLM numbers them 1, 2, … that way)."""
        return dict(item.partition("=")[::2] for item in self.lora_modules)


class AgentSettings(BaseModel):
    """The sidecar that turns one engine's metrics and KV events into kvgate topics."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node_id: str = Field(default="node-0", min_length=1)
    engine_url: str = "http://127.0.0.1:8100"
    engine_kind: Literal["vllm", "sglang"] = Field(
        default="vllm",
        description="sglang: SGLang's metrics; without kv_events_endpoint its cache is inferred "
        "by the routers from their own decisions (marked approximate)",
    )
    kv_events_endpoint: str | None = "tcp://127.0.0.1:5557"
    kv_events_bind: bool = Field(
        default=False,
        description="bind kv_events_endpoint and let the engine dial in (engines that publish "
        "to a collector, as in llm-d) instead of connecting to the engine's PUB socket; the "
        "replay socket is the engine's either way",
    )
    kv_events_replay_endpoint: str | None = Field(
        default=None,
        description="the engine's KV-event replay socket (vLLM's `replay_endpoint`): lost "
        "batches are fetched from it",
    )
    engine_api_key: SecretStr | None = Field(
        default=None,
        description="the engine's --api-key, for its /v1 endpoints (adapters, pre-warming)",
    )
    advertise_url: str | None = Field(
        default=None,
        description="the engine's URL as routers reach it, when it differs from engine_url (a "
        "sidecar scrapes http://127.0.0.1:8000 and advertises http://<pod IP>:8000)",
    )
    pool: str = "default"
    fit_watermark: float = Field(
        default=0.01,
        ge=0,
        lt=1,
        description="share of the engine's KV blocks kept free (vLLM's block manager watermark): "
        "what the heartbeat's kv_blocks_admissible leaves out",
    )
    role: Literal["mixed", "prefill", "decode"] = Field(
        default="mixed",
        description="what routers use the engine for: mixed (whole requests), prefill or decode "
        "(disaggregated prefill; the engine needs a KV connector, e.g. NixlConnector)",
    )
    kv_link_gbps: float | None = Field(
        default=None, gt=0, description="the engine's KV transfer bandwidth (Gbit/s)"
    )
    retention_hints: bool = Field(
        default=False,
        description="the engine keeps a finished request's KV for the TTL of its agent_hint "
        "(session_id, cache_control.ttl: the shape of vLLM's session-aware KV hints RFC; "
        "kvgate's simulated engine): routers then ask it to keep a session's prefix between "
        "its turns",
    )
    kv_pull: bool = Field(
        default=False,
        description="the engine's KV connector gives and takes a prefix: it keeps a prefix "
        "sent with kv_transfer_params do_remote_decode for another engine, and a request with "
        "do_remote_prefill loads the blocks the params list and computes the rest (kvgate's "
        "simulated engine with kv_transfer; vLLM with a connector that loads a partial prefix, "
        "docs/engines.md): routers may pull a busy holder's prefix to it",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="the node's labels, e.g. {zone: eu-1a, gpu: h100}: requests and tenants "
        "may require or prefer them, routers prefer their own zone",
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="the engine's data-parallel ranks (vLLM's --data-parallel-size): each is a "
        "node of its own (<node_id>-dp<rank>) with its own KV events (the endpoint's port + "
        "rank) and load (its engine label); routers pin its requests with X-data-parallel-rank",
    )
    data_parallel_rank: int | None = Field(
        default=None, ge=0, description="set per rank by the agent itself; not configured"
    )
    heartbeat_interval_s: float = Field(default=0.5, gt=0)
    kv_flush_interval_s: float = Field(default=0.1, gt=0)
    kv_flush_max_blocks: int = Field(default=2000, gt=0)
    kv_silence_s: float = Field(
        default=10.0,
        gt=0,
        description="the engine prefills but no KV event arrives (or none translates) for this "
        "long: heartbeats say kv_index: degraded",
    )
    snapshot_interval_s: float = Field(default=30.0, gt=0)
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535, description="serve /metrics and /health here (off: unset)"
    )
    metrics_host: str = "127.0.0.1"
    models_interval_s: float = Field(
        default=10.0, gt=0, description="how often to read the engine's /v1/models (adapters)"
    )
    lease_s: float = Field(default=2.0, gt=0)
    drain_on_stop_s: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="on SIGTERM (a scale-down, a pod deleted), heartbeats say draining this long "
        "before the agent exits: routers send the node nothing new and move its streams after "
        "router.drain_grace_s (give the engine a preStop hook at least this long)",
    )
    scrape_timeout_s: float = Field(default=1.0, gt=0)
    prewarm: bool = Field(default=True, description="act on pre-warm advice from kvgate.control")
    prefill_probe: bool = Field(
        default=True,
        description="measure the engine's prefill rate when the agent starts and after each "
        "engine restart, while the engine is idle (a few one-token completions of uncached "
        "prompts); heartbeats carry it so that routers price a miss in the engine's real "
        "seconds from the first request",
    )
    prefill_probe_tokens: int = Field(
        default=2048, ge=64, le=65_536, description="the long probe prompt (about; in words)"
    )
    prefill_probe_timeout_s: float = Field(
        default=30.0, gt=0, le=600, description="the whole probe at most (then retried later)"
    )

    def ranks(self) -> list[AgentSettings]:
        """One agent's settings per data-parallel rank (itself when there is one rank)."""
        from agents.vllm_events import rank_endpoint

        if self.data_parallel_size == 1:
            return [self]
        return [
            self.model_copy(
                update={
                    "node_id": f"{self.node_id}-dp{rank}",
                    "kv_events_endpoint": rank_endpoint(self.kv_events_endpoint, rank),
                    "kv_events_replay_endpoint": rank_endpoint(
                        self.kv_events_replay_endpoint, rank
                    ),
                    "data_parallel_rank": rank,
                }
            )
            for rank in range(self.data_parallel_size)
        ]

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)
