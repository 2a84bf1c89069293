import random

from agents.profile import EngineProfile, kv_bytes_per_token
from agents.scheduler import EngineCore, Sequence


def run(core: EngineCore, now: float = 0.0) -> float:
    while not core.idle:
        now += core.step(now).duration_s
    return now


def seq(rid: str, prompt: list[int], out: int = 4) -> Sequence:
    return Sequence(rid, prompt, out, 0.0, random.Random(1))


def test_default_profile_is_the_documented_h100_llama8b() -> None:
    p = EngineProfile()
    assert kv_bytes_per_token(32, 8, 128, 2) == 131072 == p.kv_bytes_per_token
    # (79.6 × 0.9 − 14.96 − 4.0) GiB / (128 KiB × 16) blocks
    assert p.num_gpu_blocks == int((79.6 * 0.9 - 14.96 - 4.0) * 2**30 // (131072 * 16))
    assert 25_000 < p.num_gpu_blocks < 28_000


def test_step_time_grows_with_batch_context_and_prefill() -> None:
    p = EngineProfile()
    assert p.step_time_s(0, 0, 0) == 0.0
    assert p.step_time_s(1, 100, 0) < p.step_time_s(64, 100, 0) < p.step_time_s(64, 100_000, 0)
    assert p.step_time_s(1, 100, 0) < p.step_time_s(1, 100, 4096)
    assert abs(p.step_time_s(0, 0, 25_000) - (p.step_base_s + 1.0)) < 1e-9


def test_second_request_with_same_prefix_hits_the_cache() -> None:
    core = EngineCore(EngineProfile(num_gpu_blocks_override=64, block_size=4))
    prompt = list(range(40))
    a = seq("a", prompt)
    core.add(a)
    run(core)
    b = seq("b", prompt[:32] + [7] * 8)
    core.add(b)
    run(core)
    assert a.cached_tokens == 0 and b.cached_tokens == 32
    assert len(a.output) == 4 and a.first_token_s is not None
    assert core.prefix_hits_tokens == 32 and core.prefix_queries_tokens == 80


def test_full_prompt_hit_still_computes_one_token() -> None:
    core = EngineCore(EngineProfile(num_gpu_blocks_override=64, block_size=4))
    for rid in ("a", "b"):
        core.add(seq(rid, list(range(16))))
        run(core)
    assert core.prefix_hits_tokens == 12


def test_continuous_batching_emits_one_token_per_step_per_request() -> None:
    core = EngineCore(EngineProfile(num_gpu_blocks_override=256, block_size=16))
    seqs = [seq(str(i), list(range(i * 100, i * 100 + 50)), out=10) for i in range(5)]
    for s in seqs:
        core.add(s)
    first = core.step(0.0)
    assert first.prefill_tokens == 250 and len(first.tokens) == 5
    second = core.step(first.duration_s)
    assert second.decode_seqs == 5 and len(second.tokens) == 5


def test_memory_pressure_preempts_and_everything_still_finishes() -> None:
    core = EngineCore(EngineProfile(num_gpu_blocks_override=12, block_size=4))
    seqs = [seq(str(i), list(range(i * 50, i * 50 + 12)), out=12) for i in range(4)]
    for s in seqs:
        core.add(s)
    run(core)
    assert all(len(s.output) == 12 for s in seqs)
    assert core.preemptions_total > 0
    assert core.cache.used_blocks == 0


def test_abort_frees_blocks() -> None:
    core = EngineCore(EngineProfile(num_gpu_blocks_override=32, block_size=4))
    s = seq("a", list(range(30)), out=100)
    core.add(s)
    core.step(0.0)
    assert core.cache.used_blocks > 0
    core.abort(s)
    assert core.cache.used_blocks == 0 and core.idle
