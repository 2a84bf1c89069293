"""The simulator's engine (analytics.sim.simcore) against the live engine's EngineCore, step by
step on random workloads: same schedule, durations, tokens, cache contents and eviction order."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from agents.kvcache import BlockRemoved, BlockStored, CacheEvent, KvCache
from agents.profile import EngineProfile
from agents.scheduler import EngineCore, Sequence
from analytics.sim.simcore import SimCore, SimSeq


def _workload(
    rng: random.Random, n: int, bs: int, max_prompt_blocks: int, max_out: int
) -> list[tuple[float, str, int, int, list[int]]]:
    """(arrival, id, prompt tokens, max tokens, block hashes): shared prefixes, and follow-ups
    whose prompt is an earlier request's prompt and answer (multi-turn)."""
    out: list[tuple[float, str, int, int, list[int]]] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(60.0)
        max_tokens = rng.randint(1, max_out)
        if out and rng.random() < 0.3:  # a follow-up turn
            _, _, p0, m0, h0 = rng.choice(out)
            prefix = h0[: (p0 + m0) // bs]
            extra = rng.randint(0, 3 * bs)
            prompt = len(prefix) * bs + extra
        else:
            shared = rng.choice((0, 0, 1, 2))
            blocks = range(rng.randint(0, 6)) if shared else range(0)
            prefix = [900_000 + shared * 1000 + b for b in blocks]
            prompt = len(prefix) * bs + rng.randint(1, max_prompt_blocks * bs)
        total = (prompt + max_tokens) // bs
        hashes = prefix[: prompt // bs] + [(i + 1) * 10_000 + b for b in range(total)]
        out.append((t, f"r{i}", prompt, max_tokens, hashes[:total]))
    return out


def _engines(profile: EngineProfile) -> tuple[EngineCore, SimCore, list[tuple[Sequence, SimSeq]]]:
    return EngineCore(profile, token_ids_in_events=False), SimCore(profile), []


def _arrive(
    work: list[tuple[float, str, int, int, list[int]]],
    i: int,
    t: float,
    ref: EngineCore,
    sim: SimCore,
    pairs: list[tuple[Sequence, SimSeq]],
) -> int:
    """Add the requests due at ``t`` to both engines; returns the next request's index."""
    while i < len(work) and work[i][0] <= t:
        _, rid, prompt, max_tokens, hashes = work[i]
        a = Sequence(rid, bytes(prompt), max_tokens, t, random.Random(i), list(hashes))
        b = SimSeq(rid, prompt, max_tokens, list(hashes))
        ref.add(a)
        sim.add(b)
        pairs.append((a, b))
        i += 1
    return i


def _flat(events: list[CacheEvent]) -> Counter[tuple[str, int]]:
    got: Counter[tuple[str, int]] = Counter()
    for ev in events:
        if isinstance(ev, BlockStored):
            got.update(("stored", h) for h in ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            got.update(("removed", h) for h in ev.block_hashes)
    return got


def _same_cache(a: KvCache, b: KvCache) -> None:
    assert a._refs == b._refs
    assert list(a._lru) == list(b._lru)  # the same eviction order
    assert a._anon == b._anon


PROFILES = [
    # plenty of memory
    EngineProfile(num_gpu_blocks_override=2000, block_size=4, max_num_seqs=32),
    # tight memory: preemption, recompute of preempted answers
    EngineProfile(num_gpu_blocks_override=90, block_size=4, max_num_seqs=24),
    # small token budget: chunked prefill over several steps
    EngineProfile(
        num_gpu_blocks_override=300, block_size=8, max_num_seqs=16, max_num_batched_tokens=40
    ),
    # one slot at a time
    EngineProfile(num_gpu_blocks_override=200, block_size=16, max_num_seqs=1),
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("profile", PROFILES, ids=["roomy", "tight", "chunked", "single"])
def test_every_step_is_engine_cores(profile: EngineProfile, seed: int) -> None:
    rng = random.Random(seed)
    bs = profile.block_size
    work = _workload(rng, 120, bs, 8, 60)
    ref, sim, pairs = _engines(profile)
    t, i, steps = 0.0, 0, 0
    while i < len(work) or not ref.idle:
        i = _arrive(work, i, t, ref, sim, pairs)
        if ref.idle:
            assert sim.idle
            t = work[i][0]
            continue
        got, want = sim.step(t), ref.step(t)
        steps += 1
        assert got.duration_s == want.duration_s
        assert got.decode_seqs == want.decode_seqs and got.prefill_tokens == want.prefill_tokens
        assert [s.request_id for s in got.finished] == [s.request_id for s in want.finished]
        assert [s.request_id for s in got.first] == [
            s.request_id for s, _ in want.tokens if len(s.output) == 1
        ]
        assert _flat(sim.drain_events()) == _flat(ref.drain_events())
        _same_cache(sim.cache, ref.cache)
        for a, b in pairs:
            assert sim.output_tokens(b) == len(a.output), a.request_id
            assert b.finished == a.finished and b.first_token_s == a.first_token_s
        assert len(sim.waiting) == len(ref.waiting) and len(sim.running) == len(ref.running)
        t += want.duration_s
    assert i == len(work) and sim.idle
    assert steps > 100
    for name in (
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_hits_tokens",
        "preemptions_total",
    ):
        assert getattr(sim, name) == getattr(ref, name), name
    assert [b.cached_tokens for _, b in pairs] == [a.cached_tokens for a, _ in pairs]
    if profile.num_gpu_blocks == 90:
        assert ref.preemptions_total > 0  # the tight profile really preempts


@pytest.mark.parametrize("seed", range(4))
def test_decode_runs_match_engine_core_stepping(seed: int) -> None:
    """Where EngineCore plans a run of pure decode steps, SimCore plans the same run, and
    applying it at once leaves what stepping EngineCore through it leaves."""
    profile = EngineProfile(num_gpu_blocks_override=400, block_size=4, max_num_seqs=32)
    rng = random.Random(seed)
    work = _workload(rng, 100, 4, 6, 80)
    ref, sim, pairs = _engines(profile)
    t, i, runs = 0.0, 0, 0
    while i < len(work) or not ref.idle:
        i = _arrive(work, i, t, ref, sim, pairs)
        if ref.idle:
            t = work[i][0]
            continue
        plan, want_plan = sim.plan_decode_run(), ref.plan_decode_run()
        assert plan == want_plan
        if plan is None:
            got, want = sim.step(t), ref.step(t)
            assert got.duration_s == want.duration_s
            t += want.duration_s
        else:
            runs += 1
            finished = [s.request_id for s in sim.advance_decode(plan.steps)]
            want_finished: list[str] = []
            for k in range(plan.steps):
                res = ref.step(t + plan.elapsed(k))
                assert res.duration_s == pytest.approx(plan.first_s + k * plan.grow_s)
                want_finished += [s.request_id for s in res.finished]
            assert finished == want_finished and finished
            t += plan.elapsed(plan.steps)
        assert _flat(sim.drain_events()) == _flat(ref.drain_events())
        _same_cache(sim.cache, ref.cache)
        for a, b in pairs:
            assert sim.output_tokens(b) == len(a.output)
    assert runs > 5
    assert sim.generation_tokens_total == ref.generation_tokens_total


def test_requests_must_bring_every_block_hash() -> None:
    sim = SimCore(EngineProfile(num_gpu_blocks_override=100, block_size=4))
    with pytest.raises(ValueError, match="every full block"):
        sim.add(SimSeq("r", 16, 8, [1, 2, 3]))
