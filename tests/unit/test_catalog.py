"""Engine profiles derived from config.json figures and datasheets (agents/catalog.py)."""

from __future__ import annotations

import pytest

from agents.catalog import GPUS, MODELS, derive_profile, find_gpu, find_model, replica_gpus
from agents.profile import EngineProfile, attention_pairs, experts_touched


def test_the_default_profile_is_llama_8b_on_h100_derived() -> None:
    default = EngineProfile()
    derived = derive_profile(find_model("llama-3.1-8b"), find_gpu("h100"))
    for field in (
        "weights_gib",
        "step_base_s",
        "step_per_context_token_s",
        "prefill_tokens_per_s",
        "prefill_attention_s_per_pair",
    ):
        assert getattr(derived, field) == pytest.approx(getattr(default, field), rel=0.01), field
    assert abs(derived.num_gpu_blocks - default.num_gpu_blocks) <= 2


@pytest.mark.parametrize(
    ("alias", "per_token"),
    [
        # 2 (K and V) × layers × KV heads × head dim × 2 bytes, from each config.json
        ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),
        ("llama-3.1-70b", 2 * 80 * 8 * 128 * 2),
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),
        ("llama-2-7b", 2 * 32 * 32 * 128 * 2),  # multi-head attention: 4× Llama-3's
        ("mixtral-8x7b", 2 * 32 * 8 * 128 * 2),
        ("qwen3-30b-a3b", 2 * 48 * 4 * 128 * 2),
    ],
)
def test_kv_bytes_per_token_follow_the_formula(alias: str, per_token: int) -> None:
    m = find_model(alias)
    tp = replica_gpus(m, find_gpu("h100"))
    p = derive_profile(m, find_gpu("h100"), tp)
    assert p.kv_bytes_per_token * tp == per_token


def test_tensor_parallel_splits_weights_and_kv_heads() -> None:
    m, g = find_model("llama-3.1-70b"), find_gpu("h100")
    p2, p4 = derive_profile(m, g, 2), derive_profile(m, g, 4)
    assert p4.weights_gib == pytest.approx(p2.weights_gib / 2, rel=1e-3)
    assert p4.kv_bytes_per_token == p2.kv_bytes_per_token // 2
    assert p4.num_gpu_blocks > 10 * p2.num_gpu_blocks  # 2 × H100 barely hold the weights
    assert replica_gpus(m, g) == 4 and replica_gpus(m, find_gpu("h200")) == 2
    qwen = find_model("qwen2.5-7b")  # 4 KV heads over 8 GPUs: one (replicated) head each
    assert derive_profile(qwen, g, 8).kv_heads == 1
    with pytest.raises(ValueError, match="no memory"):
        derive_profile(m, g, 1)
    with pytest.raises(ValueError, match="power of two"):
        derive_profile(m, g, 3)


def test_moe_weights_count_all_experts_and_steps_read_the_touched_ones() -> None:
    mixtral = find_model("mixtral-8x7b")
    assert mixtral.params_b * 2 > 90  # all experts live in memory: ~93 GB in bf16
    p = derive_profile(mixtral, find_gpu("h200"))
    one = p.step_time_s(1, 0, 0)
    many = p.step_time_s(64, 0, 0)
    # batch 1 reads 2 of 8 experts, batch 64 all 8 (and 63 more sequences' bookkeeping)
    assert many - one == pytest.approx(
        p.moe_expert_read_s * (8 - 2) + 63 * p.step_per_seq_s, rel=0.01
    )
    assert experts_touched(8, 2, 1) == pytest.approx(2.0)
    assert experts_touched(128, 8, 10_000) == pytest.approx(128.0)
    dense = derive_profile(find_model("llama-3.1-8b"), find_gpu("h100"))
    assert dense.moe_experts == 0


def test_prefill_grows_faster_than_linearly_with_context() -> None:
    p = EngineProfile()
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(10, 2) == 11 + 12
    short = p.step_time_s(0, 0, 8192, attention_pairs(0, 8192))
    late = p.step_time_s(0, 0, 8192, attention_pairs(65_536, 8192))  # the same chunk, deep in
    assert late > 1.5 * short
    # a cache hit skips the linear work of the cached tokens, not the attention over them
    assert p.step_time_s(0, 0, 100, attention_pairs(60_000, 100)) > p.step_time_s(
        0, 0, 100, attention_pairs(0, 100)
    )


def test_every_pair_that_fits_has_a_usable_profile() -> None:
    pairs = 0
    for m in MODELS:
        for g in GPUS:
            p = derive_profile(m, g, replica_gpus(m, g))
            assert p.num_gpu_blocks * p.block_size >= 32_768  # a long prompt fits
            assert 0.001 < p.step_time_s(1, 1000, 0) < 0.1
            pairs += 1
    assert pairs >= 6
    with pytest.raises(ValueError, match="known"):
        find_model("gpt-5")
