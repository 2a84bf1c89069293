"""Prometheus exposition of an engine in vLLM's metric names, and the parser the agent uses.

The names follow vLLM's V1 metrics (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` and
its older alias ``vllm:gpu_cache_usage_perc``, ``vllm:prefix_cache_{queries,hits}_total``,
``vllm:cache_config_info`` carrying ``block_size`` and ``num_gpu_blocks`` as labels), so the agent's
vLLM adapter reads a real vLLM and the simulated engine alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from agents.scheduler import EngineCore

__all__ = ["EngineStats", "parse_metrics", "render_metrics", "render_sglang_metrics"]


def render_metrics(core: EngineCore, model_name: str, started_s: float | None = None) -> bytes:
    p = core.profile
    lbl = f'engine="0",model_name="{model_name}"'
    usage = core.cache.usage()
    lines = [
        # prometheus_client's process collector, which vLLM's /metrics includes
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {started_s if started_s is not None else 0.0}",
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lbl}}} {len(core.running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lbl}}} {len(core.waiting)}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lbl}}} {usage}",
        "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:gpu_cache_usage_perc gauge",
        f"vllm:gpu_cache_usage_perc{{{lbl}}} {usage}",
        "# HELP vllm:prefix_cache_queries Prefix cache queries, in number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries counter",
        f"vllm:prefix_cache_queries_total{{{lbl}}} {core.prefix_queries_tokens}",
        "# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits counter",
        f"vllm:prefix_cache_hits_total{{{lbl}}} {core.prefix_hits_tokens}",
        "# HELP vllm:prompt_tokens Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens counter",
        f"vllm:prompt_tokens_total{{{lbl}}} {core.prompt_tokens_total}",
        "# HELP vllm:generation_tokens Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens counter",
        f"vllm:generation_tokens_total{{{lbl}}} {core.generation_tokens_total}",
        "# HELP vllm:num_preemptions Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions counter",
        f"vllm:num_preemptions_total{{{lbl}}} {core.preemptions_total}",
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{p.block_size}",enable_prefix_caching="True",'
        f'engine="0",gpu_memory_utilization="{p.gpu_memory_utilization}",'
        f'num_gpu_blocks="{core.cache.num_blocks}"}} 1.0',
    ]
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
    core: EngineCore, model_name: str, started_s: float | None = None
) -> bytes:
    """What an SGLang server's ``/metrics`` shows (the names of its metrics collector)."""
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


def parse_metrics(text: str) -> EngineStats:
    """Sum each metric over its label sets (several engines behind one data-parallel server)."""
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    model: str | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:cache_config_info":
                info = dict(sample.labels)
                continue
            model = model or sample.labels.get("model_name")
            values[name] = values.get(name, 0.0) + sample.value
    if "sglang:num_running_reqs" in values:
        return _sglang(values, model)
    usage = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", 0.0))
    return EngineStats(
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=usage,
        block_size=int(info.get("block_size", "16")),
        num_gpu_blocks=int(float(info.get("num_gpu_blocks", "0") or 0)),
        prompt_tokens_total=values.get("vllm:prompt_tokens_total", 0.0),
        generation_tokens_total=values.get("vllm:generation_tokens_total", 0.0),
        prefix_queries_total=values.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_hits_total=values.get("vllm:prefix_cache_hits_total", 0.0),
        model_name=model,
        start_time_s=values.get("process_start_time_seconds") or None,
    )
