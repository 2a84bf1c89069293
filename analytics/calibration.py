"""The engine model next to published measurements of the engines it stands for.

Each :class:`Published` row is one figure somebody else measured (with its source), and the
quantity the engine model predicts for the same setting: a prompt's prefill alone on an idle
replica (``prompt``), or a batch of equal requests started together and run to their last token
(``batch``, what vLLM's ``benchmark_latency`` reports). ``docs/engine-model.md`` shows the table
and ``tests/unit/test_calibration_rows.py`` holds the model to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.catalog import derive_profile, find_gpu, find_model
from agents.profile import batch_latency_s, idle_ttft_s

__all__ = ["PUBLISHED", "Published", "calibration_rows"]

# vLLM's performance benchmark (its CI): latency test, batch 8, 32 prompt and 128 output tokens,
# bf16, median end-to-end latency. H200: buildkite.com/vllm/performance-benchmark/builds/9515;
# H100: the same report as stored at buildkite.com/elastic/enterprise-search-ruby/builds/571
# ("8xH100", a copy of vLLM's tables under another pipeline's address).
_VLLM_LATENCY = "vLLM performance benchmark, latency test (batch 8, 32 in, 128 out, median)"


@dataclass(frozen=True, slots=True)
class Published:
    what: str
    model: str  # agents.catalog alias
    gpu: str
    tp: int
    published_s: float
    source: str
    prompt_tokens: int
    batch: int = 0  # 0: the prompt's prefill alone; else a batch run to output_tokens
    output_tokens: int = 0

    def predicted_s(self) -> float:
        profile = derive_profile(find_model(self.model), find_gpu(self.gpu), self.tp)
        if self.batch:
            return batch_latency_s(profile, self.batch, self.prompt_tokens, self.output_tokens)
        return idle_ttft_s(profile, self.prompt_tokens)


def _vllm_latency(model: str, gpu: str, tp: int, median_ms: float, build: str) -> Published:
    return Published(
        what=f"{model} TP{tp} on {gpu.upper()}: batch 8 × (32 in, 128 out), end to end",
        model=model,
        gpu=gpu,
        tp=tp,
        published_s=median_ms / 1e3,
        source=f"{_VLLM_LATENCY}, {build}",
        prompt_tokens=32,
        batch=8,
        output_tokens=128,
    )


PUBLISHED: tuple[Published, ...] = (
    Published(
        what="prefill of a 1M-token prompt, 8B model, one A100",
        model="llama-3.1-8b",
        gpu="a100",
        tp=1,
        published_s=30 * 60.0,
        source="MInference 1.0 (Jiang et al., NeurIPS 2024), abstract: 30 minutes for an 8B "
        "LLM to pre-fill 1M tokens on a single A100",
        prompt_tokens=1_000_000,
    ),
    _vllm_latency("llama-3.1-8b", "h200", 1, 833.53, "H200 build 9515"),
    _vllm_latency("llama-3.1-70b", "h200", 4, 2077.56, "H200 build 9515"),
    _vllm_latency("mixtral-8x7b", "h200", 2, 1916.58, "H200 build 9515"),
    _vllm_latency("llama-3.1-8b", "h100", 1, 997.365, "H100 report"),
    _vllm_latency("llama-3.1-70b", "h100", 4, 2444.3, "H100 report"),
    _vllm_latency("mixtral-8x7b", "h100", 2, 2330.57, "H100 report"),
)


def calibration_rows() -> list[dict[str, Any]]:
    """Every published figure with the model's prediction and its relative error."""
    rows = []
    for p in PUBLISHED:
        predicted = p.predicted_s()
        rows.append(
            {
                "what": p.what,
                "published_s": p.published_s,
                "model_s": round(predicted, 4),
                "error": round(predicted / p.published_s - 1, 4),
                "source": p.source,
            }
        )
    return rows
