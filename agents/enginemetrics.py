"""Prometheus exposition of an engine in vLLM's metric names, and the parser the agent uses.

The names follow vLLM's V1 metrics (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` and
its older alias ``vllm:gpu_cache_usage_perc``, ``vllm:prefix_cache_{queries,hits}_total``,
``vllm:cache_config_info`` carrying ``block_size`` and ``num_gpu_blocks`` as labels), so the agent's
vLLM adapter reads a real vLLM and the simulated engine alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from agents.scheduler import EngineCore

__all__ = ["EngineStats", "parse_metrics", "render_metrics", "render_sglang_metrics"]


_VLLM_ROWS: list[tuple[str, str, str, Callable[[EngineCore], float]]] = [
    # (name, type, help, value of one engine core)
    (
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        lambda c: len(c.running),
    ),
    (
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        lambda c: len(c.waiting),
    ),
    (
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        lambda c: c.cache.usage(),
    ),
    (
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "GPU KV-cache usage. 1 means 100 percent usage.",
        lambda c: c.cache.usage(),
    ),
    (
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in number of queried tokens.",
        lambda c: c.prefix_queries_tokens,
    ),
    (
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        lambda c: c.prefix_hits_tokens,
    ),
    (
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        lambda c: c.prompt_tokens_total,
    ),
    (
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        lambda c: c.generation_tokens_total,
    ),
    (
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        lambda c: c.preemptions_total,
    ),
]


def render_metrics(
    cores: Sequence[EngineCore], model_name: str, started_s: float | None = None
) -> bytes:
    """vLLM's ``/metrics``: one sample per engine core (``engine`` label = its data-parallel
    rank) under each metric."""
    lines = [
        # prometheus_client's process collector, which vLLM's /metrics includes
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {started_s if started_s is not None else 0.0}",
    ]
    for name, kind, help_text, value in _VLLM_ROWS:
        family = name[: -len("_total")] if kind == "counter" else name
        lines += [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}"]
        for rank, core in enumerate(cores):
            lbl = f'engine="{rank}",model_name="{model_name}"'
            lines.append(f"{name}{{{lbl}}} {value(core)}")
    lines += [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
    ]
    for rank, core in enumerate(cores):
        p = core.profile
        lines.append(
            f'vllm:cache_config_info{{block_size="{p.block_size}",enable_prefix_caching="True",'
            f'engine="{rank}",gpu_memory_utilization="{p.gpu_memory_utilization}",'
            f'num_gpu_blocks="{core.cache.num_blocks}"}} 1.0'
        )
    return ("\n".join(lines) + "\n").encode()


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What the agent reads from one scrape of an engine's ``/metrics``."""

    running: int
    waiting: int
    kv_usage: float
    block_size: int
    num_gpu_blocks: int
    prompt_tokens_total: float
    generation_tokens_total: float
    prefix_queries_total: float
    prefix_hits_total: float
    model_name: str | None
    start_time_s: float | None = None  # the engine process's start (a change: it restarted)
    kind: str = "vllm"  # whose metric names these were
    prefix_hit_rate: float | None = None  # SGLang reports a rate, not counters

    def hit_rate(self) -> float:
        if self.prefix_hit_rate is not None:
            return self.prefix_hit_rate
        queries = self.prefix_queries_total
        return self.prefix_hits_total / queries if queries else 0.0


def _sglang(values: dict[str, float], model: str | None, block_size: int = 16) -> EngineStats:
    """SGLang's names (``--enable-metrics``). Its KV pool is counted in tokens; kvgate counts
    blocks of ``block_size`` tokens (the router's hashing unit for this node)."""
    tokens = values.get("sglang:max_total_num_tokens", 0.0)
    return EngineStats(
        running=int(values.get("sglang:num_running_reqs", 0)),
        waiting=int(values.get("sglang:num_queue_reqs", 0)),
        kv_usage=values.get("sglang:token_usage", 0.0),
        block_size=block_size,
        num_gpu_blocks=int(tokens // block_size),
        prompt_tokens_total=values.get("sglang:prompt_tokens_total", 0.0),
        generation_tokens_total=values.get("sglang:generation_tokens_total", 0.0),
        prefix_queries_total=0.0,
        prefix_hits_total=0.0,
        model_name=model,
        start_time_s=values.get("process_start_time_seconds") or None,
        kind="sglang",
        prefix_hit_rate=values.get("sglang:cache_hit_rate", 0.0),
    )


def render_sglang_metrics(
    cores: Sequence[EngineCore], model_name: str, started_s: float | None = None
) -> bytes:
    """What an SGLang server's ``/metrics`` shows (the names of its metrics collector); a
    simulated SGLang has one engine core."""
    core = cores[0]
    p = core.profile
    lbl = f'model_name="{model_name}"'
    used = core.cache.used_blocks * p.block_size
    queries = core.prefix_queries_tokens
    hit_rate = core.prefix_hits_tokens / queries if queries else 0.0
    rows = [
        ("process_start_time_seconds", "gauge", "", started_s or 0.0),
        ("sglang:num_running_reqs", "gauge", lbl, len(core.running)),
        ("sglang:num_queue_reqs", "gauge", lbl, len(core.waiting)),
        ("sglang:num_used_tokens", "gauge", lbl, used),
        ("sglang:token_usage", "gauge", lbl, core.cache.usage()),
        ("sglang:max_total_num_tokens", "gauge", lbl, core.cache.num_blocks * p.block_size),
        ("sglang:cache_hit_rate", "gauge", lbl, hit_rate),
        ("sglang:prompt_tokens_total", "counter", lbl, core.prompt_tokens_total),
        ("sglang:generation_tokens_total", "counter", lbl, core.generation_tokens_total),
    ]
    lines = []
    for name, kind, labels, value in rows:
        family = name[: -len("_total")] if kind == "counter" else name
        lines += [f"# HELP {family} {family}", f"# TYPE {family} {kind}"]
        lines.append(f"{name}{{{labels}}} {float(value)}" if labels else f"{name} {float(value)}")
    return ("\n".join(lines) + "\n").encode()


_MEANS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # shares: averaged


def parse_metrics(text: str, engine: str | None = None) -> EngineStats:
    """One engine's figures. ``engine``: only that data-parallel rank's samples (vLLM labels
    each engine core's samples ``engine="<rank>"``); None: the whole server — counts summed over
    the engine cores, KV usage averaged."""
    values: dict[str, float] = {}
    seen: dict[str, int] = {}
    info: dict[str, str] = {}
    model: str | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if engine is not None and sample.labels.get("engine", engine) != engine:
                continue
            if name == "vllm:cache_config_info":  # per engine core: capacities add up
                blocks = float(sample.labels.get("num_gpu_blocks", "0") or 0)
                info = info or dict(sample.labels)
                values[name] = values.get(name, 0.0) + blocks
                continue
            model = model or sample.labels.get("model_name")
            values[name] = values.get(name, 0.0) + sample.value
            seen[name] = seen.get(name, 0) + 1
    for name in _MEANS:
        if seen.get(name, 0) > 1:
            values[name] /= seen[name]
    if "sglang:num_running_reqs" in values:
        return _sglang(values, model)
    usage = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", 0.0))
    return EngineStats(
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=usage,
        block_size=int(info.get("block_size", "16")),
        num_gpu_blocks=int(values.get("vllm:cache_config_info", 0.0)),
        prompt_tokens_total=values.get("vllm:prompt_tokens_total", 0.0),
        generation_tokens_total=values.get("vllm:generation_tokens_total", 0.0),
        prefix_queries_total=values.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_hits_total=values.get("vllm:prefix_cache_hits_total", 0.0),
        model_name=model,
        start_time_s=values.get("process_start_time_seconds") or None,
    )
