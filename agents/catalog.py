"""Models and GPUs the engine model knows, and the :class:`EngineProfile` of a model served on
``tp`` GPUs of one kind (tensor parallel), derived from public figures.

A model is what its ``config.json`` says (layers, attention heads, KV heads, head dim, experts)
plus its parameter count from the model card; a GPU is its datasheet (memory, HBM bandwidth,
dense bf16 tensor FLOP rate). ``docs/engine-model.md`` cites each figure. The derivation uses the
same constants for every pair: prefill runs at 40.6 % of the dense FLOP rate (25,000 tokens/s
for Llama-3.1-8B on one H100), attention at 50 % of it (FlashAttention-2's published range on an
A100 is 50-73 %); a decode step reads the weights at 70 % of the datasheet's memory bandwidth and
costs 1.6 ms more on the host (scheduling, sampling, launches) — those two fitted to vLLM's own
latency benchmark (8B, 70B and Mixtral on H100 and H200; ``docs/engine-model.md``, calibration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from agents.profile import GIB, EngineProfile

__all__ = [
    "GPUS",
    "MODELS",
    "GpuSpec",
    "ModelSpec",
    "derive_profile",
    "find_gpu",
    "find_model",
    "replica_gpus",
]

# fitted to vLLM's latency benchmark (docs/engine-model.md, "Calibration"): the share of the
# datasheet's HBM bandwidth a decode step achieves, and what every step costs besides its kernels
BANDWIDTH_EFFICIENCY = 0.70
STEP_OVERHEAD_S = 0.0016
FLOP_EFFICIENCY = 0.406  # model FLOP utilization of prefill (25,000 tokens/s for 8B on H100)
# causal attention kernels (FlashAttention-2 forward: 50-73 % of an A100's peak, its paper)
ATTENTION_EFFICIENCY = 0.50


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's architecture, from its ``config.json``, and its parameter count."""

    name: str  # Hugging Face id
    alias: str
    layers: int  # num_hidden_layers
    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads (== heads: multi-head attention, < heads: GQA)
    head_dim: int  # head_dim, or hidden_size / num_attention_heads
    params_b: float  # all parameters, billions (what the weights occupy)
    active_params_b: float  # parameters one token passes through, billions (== params_b: dense)
    experts: int = 0  # routed experts per layer (0: dense)
    top_k: int = 0  # experts per token (num_experts_per_tok)
    expert_params_b: float = 0.0  # one expert's parameters over all layers, billions

    @property
    def moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU's datasheet figures."""

    name: str
    alias: str
    memory_gib: float  # total memory as CUDA reports it
    bandwidth_tb_s: float  # HBM (or GDDR) bandwidth, TB/s
    bf16_tflops: float  # dense bf16 tensor-core rate (no sparsity)
    allreduce_latency_s: float  # one small all-reduce between the GPUs of a replica (assumed)


MODELS: tuple[ModelSpec, ...] = (
    ModelSpec("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b", 32, 4096, 32, 8, 128, 8.03, 8.03),
    ModelSpec(
        "meta-llama/Llama-3.1-70B-Instruct", "llama-3.1-70b", 80, 8192, 64, 8, 128, 70.55, 70.55
    ),
    ModelSpec("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b", 28, 3584, 28, 4, 128, 7.62, 7.62),
    ModelSpec("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b", 32, 4096, 32, 32, 128, 6.74, 6.74),
    ModelSpec(
        "mistralai/Mixtral-8x7B-Instruct-v0.1",
        "mixtral-8x7b",
        32,
        4096,
        32,
        8,
        128,
        46.70,
        12.88,
        experts=8,
        top_k=2,
        expert_params_b=5.637,  # 3 × 4096 × 14336 × 32 layers
    ),
    ModelSpec(
        "Qwen/Qwen3-30B-A3B",
        "qwen3-30b-a3b",
        48,
        2048,
        32,
        4,
        128,
        30.53,
        3.34,
        experts=128,
        top_k=8,
        expert_params_b=0.2265,  # 3 × 2048 × 768 × 48 layers
    ),
)

T = TypeVar("T", ModelSpec, GpuSpec)

GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("NVIDIA H100 SXM 80GB", "h100", 79.6, 3.35, 989.4, 10e-6),
    GpuSpec("NVIDIA H200 SXM 141GB", "h200", 140.4, 4.8, 989.4, 10e-6),
    GpuSpec("NVIDIA A100 SXM 80GB", "a100", 79.2, 2.039, 312.0, 12e-6),
    GpuSpec("NVIDIA L40S 48GB", "l40s", 44.5, 0.864, 362.0, 25e-6),
)


def _find(items: tuple[T, ...], key: str, what: str) -> T:
    k = key.strip().lower()
    for item in items:
        if k in (item.alias, item.name.lower()):
            return item
    known = ", ".join(i.alias for i in items)
    raise ValueError(f"unknown {what} {key!r}; known: {known}")


def find_model(key: str) -> ModelSpec:
    """A model by alias (``llama-3.1-8b``) or Hugging Face id."""
    return _find(MODELS, key, "model")


def find_gpu(key: str) -> GpuSpec:
    """A GPU by alias (``h100``) or full name."""
    return _find(GPUS, key, "GPU")


def derive_profile(
    model: ModelSpec,
    gpu: GpuSpec,
    tp: int = 1,
    *,
    dtype_bytes: int = 2,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_gib: float = 4.0,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
) -> EngineProfile:
    """The profile of one replica: ``model`` on ``tp`` GPUs ``gpu`` (tensor parallel).

    Per GPU: the weights are split ``tp`` ways; the KV heads too (a head is never split: with
    fewer KV heads than GPUs each GPU keeps one, as vLLM replicates them). Every step reads the
    GPU's share of the dense weights (the base) and of the KV read; compute runs at
    ``FLOP_EFFICIENCY`` of the datasheet on all ``tp`` GPUs, plus two all-reduces per layer.
    Raises ``ValueError`` when the weights leave no room for the KV cache.
    """
    if tp < 1 or tp & (tp - 1):
        raise ValueError("tp must be a power of two")
    if model.kv_heads % tp and tp % model.kv_heads:
        raise ValueError(f"{model.kv_heads} KV heads cannot be split over {tp} GPUs")
    bandwidth = gpu.bandwidth_tb_s * 1e12 * BANDWIDTH_EFFICIENCY  # bytes/s, one GPU
    flops = gpu.bf16_tflops * 1e12 * FLOP_EFFICIENCY * tp  # FLOP/s, the replica
    attention_flops = gpu.bf16_tflops * 1e12 * ATTENTION_EFFICIENCY * tp
    weights_bytes = model.params_b * 1e9 * dtype_bytes
    expert_bytes = model.expert_params_b * 1e9 * dtype_bytes
    dense_bytes = weights_bytes - model.experts * expert_bytes  # read by every step
    kv_heads_per_gpu = max(1, model.kv_heads // tp)
    kv_bytes_per_gpu_token = 2 * model.layers * kv_heads_per_gpu * model.head_dim * dtype_bytes
    comm = 2 * model.layers * gpu.allreduce_latency_s if tp > 1 else 0.0
    return EngineProfile(
        model=model.name,
        gpu=gpu.name if tp == 1 else f"{tp}x {gpu.name}",
        layers=model.layers,
        kv_heads=kv_heads_per_gpu,
        head_dim=model.head_dim,
        dtype_bytes=dtype_bytes,
        weights_gib=round(weights_bytes / tp / GIB, 3),
        gpu_memory_gib=gpu.memory_gib,
        gpu_memory_utilization=gpu_memory_utilization,
        activation_reserve_gib=activation_reserve_gib,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        step_base_s=dense_bytes / tp / bandwidth + comm + STEP_OVERHEAD_S,
        step_per_seq_s=0.00003,
        step_per_context_token_s=kv_bytes_per_gpu_token / bandwidth,
        prefill_tokens_per_s=flops / (2 * model.active_params_b * 1e9),
        prefill_attention_s_per_pair=(
            4 * model.layers * model.heads * model.head_dim / attention_flops
        ),
        moe_experts=model.experts,
        moe_top_k=model.top_k,
        moe_expert_read_s=expert_bytes / tp / bandwidth,
    )


def replica_gpus(
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    dtype_bytes: int = 2,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_gib: float = 4.0,
    min_kv_share: float = 0.25,
) -> int:
    """The fewest GPUs (1, 2, 4, 8) whose memory holds the weights and leaves at least
    ``min_kv_share`` of the usable memory for the KV cache (less makes a replica that holds a
    handful of long sequences: technically up, useless for serving)."""
    for tp in (1, 2, 4, 8):
        try:
            p = derive_profile(
                model,
                gpu,
                tp,
                dtype_bytes=dtype_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                activation_reserve_gib=activation_reserve_gib,
            )
        except ValueError:  # the KV heads do not split this way, or nothing is left for KV
            continue
        if p.kv_memory_gib >= min_kv_share * gpu.memory_gib * gpu_memory_utilization:
            return tp
    raise ValueError(f"{model.alias} does not fit on 8 × {gpu.alias}")
