"""SGLang's /metrics (names from SGLang's production-metrics documentation) and the approximate
index routers keep for engines without KV events."""

from __future__ import annotations

from agents.enginemetrics import parse_metrics, render_sglang_metrics
from agents.profile import EngineProfile
from agents.scheduler import EngineCore
from router.decision.approx import ApproxIndex

SGLANG = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.557572e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 162.0
# HELP sglang:num_used_tokens The number of used tokens
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 123859.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2826.0
"""


def test_sglang_metrics_are_read() -> None:
    s = parse_metrics(SGLANG)
    assert s.kind == "sglang" and s.model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert (s.running, s.waiting, s.kv_usage) == (162, 2826, 0.28)
    assert s.hit_rate() == 0.0075
    assert s.prompt_tokens_total == 8.128902e06
    assert s.num_gpu_blocks == 0  # no capacity gauge: the agent asks the server info


def test_the_simulated_engine_speaks_sglang_metrics() -> None:
    core = EngineCore(EngineProfile(num_gpu_blocks_override=1000))
    s = parse_metrics(render_sglang_metrics([core], "m", 123.0).decode())
    assert s.kind == "sglang" and s.num_gpu_blocks == 1000 and s.block_size == 16
    assert s.start_time_s == 123.0 and s.running == 0


def test_approximate_index_is_an_lru_of_what_was_sent() -> None:
    idx = ApproxIndex()
    idx.add("a", [1, 2, 3], capacity_blocks=4)
    idx.add("b", [1, 9], capacity_blocks=4)
    assert idx.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1}
    idx.add("a", [5, 6], capacity_blocks=4)  # 1 is the least recently used: evicted
    assert idx.blocks("a") == 4
    assert idx.match([1, 2, 3], ["a"]) == {}
    assert idx.match([2, 3], ["a"]) == {"a": 2}
    idx.forget("a")
    assert idx.match([2, 3], ["a"]) == {}
