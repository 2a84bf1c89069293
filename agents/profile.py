"""Performance profile of one engine replica: KV capacity and step timing.

Defaults describe Llama-3.1-8B-Instruct (bf16) served by vLLM on one NVIDIA H100 SXM 80 GB;
``docs/engine-model.md`` derives every number and cites its source. The same profile drives the
real-time simulated engine and (later) the virtual-time simulator.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "EngineProfile",
    "attention_pairs",
    "experts_touched",
    "kv_blocks_for_memory",
    "kv_bytes_per_token",
]

GIB = 1 << 30


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV cache bytes per token: 2 (K and V) × layers × KV heads × head dim × bytes."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_blocks_for_memory(kv_memory_bytes: float, bytes_per_token: int, block_size: int) -> int:
    return int(kv_memory_bytes // (bytes_per_token * block_size))


def attention_pairs(start: int, tokens: int) -> int:
    """(token, attended token) pairs of computing ``tokens`` positions from ``start`` on under a
    causal mask: position i attends over i + 1 tokens (itself and every earlier one)."""
    return tokens * start + tokens * (tokens + 1) // 2


def experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts (per layer) that ``tokens`` tokens are routed to, each token to
    ``top_k`` of ``experts`` uniformly: experts × (1 − (1 − k/E)^tokens)."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


class EngineProfile(BaseModel):
    """Capacity and timing of one replica; the timing model is linear in the step's work."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    gpu: str = "H100-SXM-80GB"
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    weights_gib: float = 14.96  # 8.03e9 parameters × 2 bytes
    gpu_memory_gib: float = 79.6  # what CUDA reports as total on an H100 80 GB
    gpu_memory_utilization: float = 0.9  # vLLM's default
    activation_reserve_gib: float = 4.0  # peak activations, CUDA graphs, non-torch memory
    block_size: int = Field(default=16, gt=0)  # vLLM's default on CUDA
    num_gpu_blocks_override: int | None = Field(default=None, gt=0)
    max_num_seqs: int = Field(default=256, gt=0)
    max_num_batched_tokens: int = Field(default=8192, gt=0)  # chunked-prefill token budget / step
    # timing: step = base + per_seq × decode batch + per_ctx × context tokens read
    #         + prefill tokens / prefill rate
    step_base_s: float = Field(default=0.00845, ge=0)  # 16 GB at 70 % of 3.35 TB/s + 1.6 ms
    step_per_seq_s: float = Field(default=0.00003, ge=0)  # sampling and scheduling per sequence
    step_per_context_token_s: float = Field(default=5.59e-8, ge=0)  # 128 KiB KV per token read
    prefill_tokens_per_s: float = Field(default=25_000.0, gt=0)  # ~41 % MFU of 989 TFLOPS
    # causal attention in prefill: each computed token attends over every earlier token of its
    # sequence (4 × layers × heads × head dim FLOPs per pair), at the prefill's FLOP rate
    # (4 × 32 × 4096 FLOPs at 50 % of 989 TFLOPS)
    prefill_attention_s_per_pair: float = Field(default=1.06e-9, ge=0)
    # mixture of experts: a step reads the weights of every expert its tokens are routed to
    # (the rest of the model is in step_base_s); 0 experts: a dense model
    moe_experts: int = Field(default=0, ge=0)
    moe_top_k: int = Field(default=0, ge=0)
    moe_expert_read_s: float = Field(default=0.0, ge=0)  # one expert's weights, all layers

    @model_validator(mode="after")
    def _fits(self) -> EngineProfile:
        if self.num_gpu_blocks < 1:
            raise ValueError("the profile leaves no memory for the KV cache")
        if self.moe_experts and not 0 < self.moe_top_k <= self.moe_experts:
            raise ValueError("moe_top_k must be within 1..moe_experts")
        return self

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def kv_memory_gib(self) -> float:
        """What vLLM leaves the KV cache: its share of the GPU less weights and activations."""
        return (
            self.gpu_memory_gib * self.gpu_memory_utilization
            - self.weights_gib
            - self.activation_reserve_gib
        )

    @property
    def num_gpu_blocks(self) -> int:
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        return kv_blocks_for_memory(
            self.kv_memory_gib * GIB, self.kv_bytes_per_token, self.block_size
        )

    def blocks_for_tokens(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def step_time_s(
        self, decode_seqs: int, context_tokens: int, prefill_tokens: int, prefill_pairs: int = 0
    ) -> float:
        """Duration of one engine step (one forward pass over the scheduled batch).

        ``context_tokens``: KV tokens the decoding sequences read; ``prefill_pairs``: the
        (token, attended token) pairs of the prefill chunks, :func:`attention_pairs` summed."""
        if decode_seqs == 0 and prefill_tokens == 0:
            return 0.0
        duration = (
            self.step_base_s
            + self.step_per_seq_s * decode_seqs
            + self.step_per_context_token_s * context_tokens
            + prefill_tokens / self.prefill_tokens_per_s
            + self.prefill_attention_s_per_pair * prefill_pairs
        )
        if self.moe_experts:
            duration += self.moe_expert_read_s * experts_touched(
                self.moe_experts, self.moe_top_k, decode_seqs + prefill_tokens
            )
        return duration


def idle_ttft_s(profile: EngineProfile, prompt_tokens: int) -> float:
    """TTFT of one prompt alone on an idle replica: its chunked prefill, step by step."""
    return batch_latency_s(profile, 1, prompt_tokens, 1) if prompt_tokens > 0 else 0.0


def batch_latency_s(
    profile: EngineProfile, batch: int, prompt_tokens: int, output_tokens: int
) -> float:
    """End-to-end time of ``batch`` equal requests started together on an idle replica (what
    vLLM's ``benchmark_latency`` measures): the prompts prefilled within the step's token budget
    (the step that completes them samples the first token), then one decode step per further
    output token with every sequence's context growing by one."""
    if batch < 1 or prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("batch, prompt_tokens and output_tokens must be positive")
    total = 0.0
    done = [0] * batch
    while done[-1] < prompt_tokens:
        budget, tokens, pairs = profile.max_num_batched_tokens, 0, 0
        for i in range(batch):
            n = min(budget - tokens, prompt_tokens - done[i])
            if n <= 0:
                continue
            pairs += attention_pairs(done[i], n)
            done[i] += n
            tokens += n
        total += profile.step_time_s(0, 0, tokens, pairs)
    for step in range(1, output_tokens):
        total += profile.step_time_s(batch, batch * (prompt_tokens + step), 0)
    return total
