import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from agents.profile import EngineProfile
from analytics.sim.cluster import simulate
from analytics.sim.metrics import run_metrics
from analytics.sim.simconfig import SimConfig
from analytics.sim.traces import Trace, TraceRequest, hit_bound, load_trace
from router.decision.policies import RoundRobinPolicy, SeedScorePolicy
from router.decision.weights import SeedWeights
from router.settings import RouterSettings

PROFILE = EngineProfile(num_gpu_blocks_override=400, block_size=16)


def req(t: float, blocks: range, out: int = 8) -> TraceRequest:
    return TraceRequest(t, len(blocks) * 16, out, tuple(b + 1000 for b in blocks))


def seed_policy() -> SeedScorePolicy:
    return SeedScorePolicy(SeedWeights(), max_kv_used_ratio=0.95, max_queue=8)


def test_a_cached_prefix_draws_the_next_request_to_its_node() -> None:
    trace = Trace("t", 16, (req(0.0, range(20)), req(2.0, range(30))))
    done = simulate(trace, seed_policy(), SimConfig(nodes=4, profile=PROFILE))
    first, second = sorted(done, key=lambda d: d.request.arrival_s)
    assert second.node == first.node and second.reason == "prefix_hit"
    assert second.hit_blocks_seen == 20
    assert second.cached_tokens == 20 * 16  # the engine really reused it


def test_the_router_cannot_see_a_prefix_before_the_index_lag() -> None:
    trace = Trace("t", 16, (req(0.0, range(20)), req(0.05, range(30))))
    done = simulate(trace, seed_policy(), SimConfig(nodes=4, profile=PROFILE, index_lag_s=5.0))
    second = max(done, key=lambda d: d.request.arrival_s)
    assert second.hit_blocks_seen == 0


def test_round_robin_spreads_evenly_and_runs_are_deterministic() -> None:
    trace = Trace("t", 16, tuple(req(i * 0.1, range(i * 10, i * 10 + 10)) for i in range(40)))
    cfg = SimConfig(nodes=4, profile=PROFILE)
    done = simulate(trace, RoundRobinPolicy(), cfg)
    m = run_metrics(done, 4, 16)
    assert m["requests"] == 40 and m["max_over_mean_load"] == 1.0 and m["load_cov"] == 0.0
    again = run_metrics(simulate(trace, RoundRobinPolicy(), cfg), 4, 16)
    assert again == m
    assert m["hit_rate"] == 0.0 and m["hit_bound"] == 0.0
    assert 0 < m["ttft_p50_s"] <= m["ttft_p99_s"] and m["slo_attainment"] == 1.0


def test_hit_bound_counts_blocks_seen_before() -> None:
    rs = [TraceRequest(0, 64, 1, (1, 2, 3, 4)), TraceRequest(1, 64, 1, (1, 2, 5, 6))]
    assert hit_bound(rs, 16) == pytest.approx(32 / 128)


def test_trace_formats(tmp_path: Path) -> None:
    moon = tmp_path / "m.jsonl"
    moon.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
                {"timestamp": 1500, "input_length": 600, "output_length": 0, "hash_ids": [0, 3]},
            ]
        )
    )
    t = load_trace(moon)
    assert t.block_size == 512 and [r.arrival_s for r in t.requests] == [0.0, 1.5]
    assert len(t.requests[0].block_hashes) == 2  # the partial third block is not cacheable
    assert t.requests[0].block_hashes[0] == t.requests[1].block_hashes[0]
    assert t.requests[1].output_tokens == 1
    az = tmp_path / "a.csv"
    az.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,48,10\n2023-11-16 18:17:04.4799600,32,8\n"
    )
    a = load_trace(az)
    assert a.block_size == 16 and a.requests[1].arrival_s == pytest.approx(0.5)
    assert len(a.requests[0].block_hashes) == 3
    assert not set(a.requests[0].block_hashes) & set(a.requests[1].block_hashes)
    with pytest.raises(ValueError, match="expected"):
        load_trace(tmp_path / "x.txt")


def test_fast_forwarded_decoding_gives_the_same_run_as_stepping() -> None:
    import random as _random

    rng = _random.Random(3)
    reqs = []
    t = 0.0
    for _ in range(300):
        t += rng.expovariate(40.0)
        start = rng.choice((0, 0, 100, 200))  # some shared prefixes
        reqs.append(req(t, range(start, start + rng.randint(1, 30)), out=rng.randint(1, 120)))
    trace = Trace("t", 16, tuple(reqs))
    runs = []
    for ff in (False, True):
        done = simulate(trace, seed_policy(), SimConfig(nodes=3, profile=PROFILE, fast_forward=ff))
        runs.append(
            sorted(
                (d.request.arrival_s, d.node, d.cached_tokens, d.first_token_s, d.finish_s)
                for d in done
            )
        )
    stepped, forwarded = runs
    assert len(stepped) == len(forwarded) == 300
    for a, b in zip(stepped, forwarded, strict=True):
        assert a[:3] == b[:3]
        assert a[3] == pytest.approx(b[3], abs=1e-9) and a[4] == pytest.approx(b[4], abs=1e-9)


def test_next_tokens_continue_next_token() -> None:
    import random as _random

    from agents.scheduler import Sequence

    seq = Sequence("r", [1] * 20, 100, 0.0, _random.Random(5))
    expected = []
    probe = Sequence("r", [1] * 20, 100, 0.0, _random.Random(5))
    for _ in range(47):
        tok = probe.next_token()
        probe.output.append(tok)
        expected.append(tok)
    seq.output.extend(seq.next_tokens(13))
    seq.output.extend(seq.next_tokens(34))
    assert seq.output == expected


def test_causal_bound_counts_only_blocks_that_could_exist() -> None:
    from analytics.sim.traces import TraceRequest, causal_hit_bound, hit_bound

    bs = 16
    first = TraceRequest(0.0, 32, 32, (1, 2), output_block_hashes=(3, 4))
    # the next turn reuses prompt (1, 2) and the answer (3, 4); prefill takes 32 / 1000 s and
    # each decode step 0.01 s: block 3 is full after 16 steps (0.192 s), block 4 after 32
    early = TraceRequest(0.1, 64, 8, (1, 2, 3, 4))  # prompt ready, answer not yet
    late = TraceRequest(1.0, 64, 8, (1, 2, 3, 4))  # everything ready
    assert hit_bound([first, early], bs) == hit_bound([first, late], bs) == 64 / 96
    assert causal_hit_bound([first, early], bs, 1000.0, 0.01) == 32 / 96
    assert causal_hit_bound([first, late], bs, 1000.0, 0.01) == 64 / 96
    at_once = TraceRequest(0.0, 32, 8, (1, 2))  # arrives with the first: nothing computed yet
    assert causal_hit_bound([first, at_once], bs, 1000.0, 0.01) == 0.0


def test_pooled_lru_bound_without_time_travel() -> None:
    """One LRU cache of the cluster's KV finds a follow-up turn's previous answer only once it
    could have been written (the causal bound's timing); without rates it enters at arrival."""
    from analytics.sim.traces import TraceRequest, causal_hit_bound, pooled_lru_bound

    bs = 16
    first = TraceRequest(0.0, 32, 32, (1, 2), output_block_hashes=(3, 4))
    early = TraceRequest(0.1, 64, 8, (1, 2, 3, 4))  # prompt ready, answer not yet
    late = TraceRequest(1.0, 64, 8, (1, 2, 3, 4))
    for turn in (early, late):
        reqs = [first, turn]
        assert pooled_lru_bound(reqs, bs, 100) == 64 / 96  # answers found before they exist
        causal = pooled_lru_bound(reqs, bs, 100, 1000.0, 0.01)
        assert causal == causal_hit_bound(reqs, bs, 1000.0, 0.01)
    assert pooled_lru_bound([first, early], bs, 100, 1000.0, 0.01) == 32 / 96
    # a cache of two blocks keeps the answer written last, not the prompt the turn starts with
    assert pooled_lru_bound([first, late], bs, 2, 1000.0, 0.01) == 0.0
    other = TraceRequest(0.05, 32, 1, (9,))  # touched after the first's prompt was cached
    third = TraceRequest(2.0, 32, 1, (1, 2))
    # capacity 3: 1, 2 (at 0.032), 9 (0.082), then the answer 3 (0.192) evicts 1
    assert pooled_lru_bound([first, other, third], bs, 3, 1000.0, 0.01) == 0.0
    assert pooled_lru_bound([first, other, third], bs, 100, 1000.0, 0.01) == 32 / 96


def test_conversation_workload_grows_long_sessions_that_reuse_their_prefix() -> None:
    from analytics.sim.workloads import make_workload

    trace = make_workload("conversation", 2000, 10.0, 3)
    assert trace == make_workload("conversation", 2000, 10.0, 3)  # a pure function of its seed
    sessions: dict[str, list[TraceRequest]] = {}
    for r in trace.requests:
        assert r.session_id is not None
        sessions.setdefault(r.session_id, []).append(r)
    prompts = sorted(r.prompt_tokens for r in trace.requests)
    assert prompts[len(prompts) // 2] >= 8_000  # tens of thousands of tokens, typically
    assert max(prompts) >= 30_000 and max(prompts) <= 64_000 + 4_000 + 2_048
    full = [turns for turns in sessions.values() if len(turns) >= 3]
    assert len(full) >= 0.8 * len(sessions)  # several turns each (the last sessions are cut)
    for turns in full:
        for a, b in itertools.pairwise(turns):
            assert b.arrival_s - a.arrival_s >= 5.0  # thinking between turns
            assert b.prompt_tokens > a.prompt_tokens + a.output_tokens - 16
            # the next prompt is the conversation so far: the previous prompt and answer
            reused = a.block_hashes + a.output_block_hashes
            assert b.block_hashes[: len(reused)] == reused


def test_ttft_floor_may_wait_for_a_prefix_another_request_is_computing() -> None:
    from analytics.sim.traces import idle_prefill_s, ttft_floors

    p = EngineProfile(block_size=16)  # chunks of 8,192 tokens: 512 blocks
    first = TraceRequest(0.0, 600 * 16, 8, tuple(range(600)))
    second = TraceRequest(0.01, 610 * 16, 8, tuple(range(610)))
    chunk = idle_prefill_s(p, 512 * 16, 0)  # the first's first 512 blocks exist after this
    whole = idle_prefill_s(p, 600 * 16, 0)  # and all 600 after this
    floors = ttft_floors([second, first], p)  # (any order: taken by arrival)
    assert floors[0] == whole
    alone = idle_prefill_s(p, 610 * 16, 0)
    after_chunk = chunk - 0.01 + idle_prefill_s(p, 610 * 16, 512 * 16)
    after_all = whole - 0.01 + idle_prefill_s(p, 610 * 16, 600 * 16)
    assert floors[1] == pytest.approx(min(alone, after_chunk, after_all))
    assert floors[1] < alone  # waiting for the prefix beats computing it again
    # arriving once everything exists: the prefill of its own 10 blocks only
    late = TraceRequest(5.0, 610 * 16, 8, tuple(range(610)))
    assert ttft_floors([first, late], p)[1] == idle_prefill_s(p, 610 * 16, 600 * 16)


@pytest.mark.parametrize("policy", ["kvgate", "least_requests", "sglang_cache_aware"])
def test_no_policy_beats_the_ttft_floor_of_any_request(policy: str) -> None:
    from analytics.sim.metrics import latency_bounds
    from analytics.sim.traces import ttft_floors
    from analytics.sim.workloads import make_workload
    from router.decision.policies import make_policy

    trace = make_workload("multi_turn", 800, 60.0, 5)  # busy: queues, spreads, evictions
    profile = EngineProfile(num_gpu_blocks_override=2_000, block_size=trace.block_size)
    done = simulate(
        trace,
        make_policy(RouterSettings(policy=policy)),
        SimConfig(nodes=4, profile=profile),
    )
    order = sorted(trace.requests, key=lambda r: r.arrival_s)
    floor = dict(zip(map(id, order), ttft_floors(trace.requests, profile), strict=True))
    assert len(done) == len(order)
    below = [d for d in done if d.first_token_s - d.request.arrival_s < floor[id(d.request)] - 1e-9]
    assert below == []
    assert any(d.cached_tokens for d in done)  # the floors were tested with hits
    ttft = run_metrics(done, 4, trace.block_size)
    bounds = latency_bounds(trace.requests, profile, ttft_slo_s=2.0)
    assert bounds["ttft_floor_p99_s"] <= ttft["ttft_p99_s"]
    assert bounds["slo_bound"] >= ttft["slo_attainment"]


def test_closed_loop_sends_a_sessions_next_turn_after_the_last_one_ends() -> None:
    """In closed loop a session's later turn arrives its think time after the previous turn's
    answer (its recorded arrival is ignored); open loop keeps the recorded times. A turn that
    is refused still releases the next one."""
    from dataclasses import replace

    turns = (
        replace(req(0.0, range(20), out=40), session_id="s"),
        replace(req(0.1, range(30), out=8), session_id="s", think_s=2.0),  # recorded: too early
        replace(req(0.2, range(40), out=8), session_id="s", think_s=0.5),
    )
    trace = Trace("t", 16, turns)
    cfg = SimConfig(nodes=2, profile=PROFILE)
    open_done = sorted(simulate(trace, seed_policy(), cfg), key=lambda d: d.request.arrival_s)
    assert [d.request.arrival_s for d in open_done] == [0.0, 0.1, 0.2]
    closed = sorted(simulate(trace.looped(), seed_policy(), cfg), key=lambda d: d.request.arrival_s)
    first, second, third = closed
    assert second.request.arrival_s == pytest.approx(first.finish_s + 2.0)
    assert third.request.arrival_s == pytest.approx(second.finish_s + 0.5)
    assert third.cached_tokens >= 30 * 16  # the conversation so far was there
    huge = replace(req(0.0, range(10_000), out=8), session_id="h")  # fits nowhere: refused
    after = replace(req(0.0, range(10), out=8), session_id="h", think_s=1.0)
    done = simulate(Trace("t", 16, (huge, after)).looped(), seed_policy(), cfg)
    assert [d.request.session_id for d in done] == ["h"] and done[0].request.arrival_s == 1.0


def test_a_client_running_sessions_at_once_starts_one_as_another_ends() -> None:
    """AIPerf's ``--concurrency``: with two slots the third session starts when the first
    session's last turn ends, not at its recorded time; the second slot's sessions run
    meanwhile."""
    from dataclasses import replace

    from analytics.sim.agenticload import sessions_at_once

    def session(sid: str, at: float, base: int) -> tuple[TraceRequest, ...]:
        return (
            replace(req(at, range(base, base + 10), out=20), session_id=sid),
            replace(req(at, range(base, base + 12), out=8), session_id=sid, think_s=1.0),
        )

    trace = Trace("t", 16, session("a", 0.0, 0) + session("b", 0.0, 100) + session("c", 9.0, 200))
    cfg = SimConfig(nodes=2, profile=PROFILE)
    done = simulate(sessions_at_once(trace, 2).looped(), seed_policy(), cfg)
    first = {d.request.session_id: d for d in done if len(d.request.block_hashes) == 10}
    last = {d.request.session_id: d for d in done if len(d.request.block_hashes) == 12}
    assert len(done) == 6
    assert first["c"].request.arrival_s == pytest.approx(last["a"].finish_s)  # not at 9.0
    assert first["a"].request.arrival_s == first["b"].request.arrival_s == 0.0
    assert last["a"].finish_s < 9.0


def test_sessions_started_one_after_another_keep_their_turns_in_order() -> None:
    """Open-loop session starts (``kvgate bench agentic``): a session's later turns move with
    its first, so the closed loop sends each after the one before it ends. A later turn whose
    recorded time sorts it ahead of its session's moved first turn would arrive on its own, at
    that recorded time, long before its session began."""
    from dataclasses import replace

    from analytics.sim.agenticload import sessions_started

    def session(sid: str, base: int) -> tuple[TraceRequest, ...]:
        return (
            replace(req(0.0, range(base, base + 10), out=20), session_id=sid),
            replace(req(2.0, range(base, base + 12), out=8), session_id=sid, think_s=1.0),
            replace(req(4.0, range(base, base + 14), out=8), session_id=sid, think_s=1.0),
        )

    trace = Trace("t", 16, session("a", 0) + session("b", 100) + session("c", 200))
    started = sessions_started(trace, sessions_per_s=0.1, seed=0)  # a session every 10 s
    for sid in "abc":
        turns = [r for r in started.requests if r.session_id == sid]
        assert [len(r.block_hashes) for r in turns] == [10, 12, 14]
    done = simulate(started.looped(), seed_policy(), SimConfig(nodes=2, profile=PROFILE))
    assert len(done) == 9
    by = {(d.request.session_id, len(d.request.block_hashes)): d for d in done}
    for k, sid in enumerate("abc"):
        assert by[(sid, 10)].request.arrival_s == pytest.approx(10.0 * k)
        # the later turns follow their session's own turns, whenever those end
        assert by[(sid, 12)].request.arrival_s == pytest.approx(by[(sid, 10)].finish_s + 1.0)
        assert by[(sid, 14)].request.arrival_s == pytest.approx(by[(sid, 12)].finish_s + 1.0)


def test_no_router_passes_the_uncontended_bound_on_tokens_per_gpu() -> None:
    """``kvgate bench agentic``'s bound: the same sessions on a cluster eight times as large
    end no later than on the real one under any router, so round-robin's span over theirs
    bounds what any router gains over round-robin in tokens per GPU; here round-robin queues
    turns behind each other and the bound is above 1."""
    from dataclasses import replace

    from analytics.sim.agenticbench import _run, _uncontended
    from analytics.sim.agenticload import sessions_started

    def session(sid: str, base: int) -> tuple[TraceRequest, ...]:
        first = replace(req(0.0, range(base, base + 100), out=100), session_id=sid)
        later = (
            replace(req(1.0 + t, range(base, base + 100 + 8 * t), out=100), session_id=sid)
            for t in range(1, 4)
        )
        return (first, *(replace(r, think_s=0.5) for r in later))

    trace = Trace("t", 16, tuple(r for k in range(16) for r in session(f"s{k}", 1000 * k)))
    started = [sessions_started(trace, 20.0, rep).looped() for rep in range(2)]
    cfg = SimConfig(nodes=2, profile=PROFILE)
    rr = [_run(t, "round_robin", replace(cfg, seed=i), 2) for i, t in enumerate(started)]
    got = _uncontended(started, cfg, 2, rr)
    assert got["nodes"] == 16 and len(got["runs"]) == 2
    assert got["tok_s_per_gpu_vs_rr_bound"] > 1.5  # round-robin queues: room to gain
    for policy in ("kvgate", "least_requests", "round_robin"):
        for rep, t in enumerate(started):
            run = rr[rep] if policy == "round_robin" else _run(t, policy, replace(cfg, seed=rep), 2)
            assert run["span_s"] >= got["runs"][rep]["span_s"]
            assert rr[rep]["span_s"] / run["span_s"] <= got["bounds"][rep]


def test_agentic_metrics_count_tokens_per_gpu_and_per_user() -> None:
    from analytics.sim.agenticload import agentic_metrics
    from analytics.sim.simconfig import Done

    a = Done(req(0.0, range(10), out=100), "n1", "x", 0, 80, first_token_s=1.0, finish_s=11.0)
    b = Done(req(5.0, range(10), out=50), "n2", "x", 0, 0, first_token_s=6.0, finish_s=21.0)
    m = agentic_metrics([a, b], requests=3, nodes=2)
    assert m["tok_s_per_gpu"] == pytest.approx(150 / 21 / 2, abs=0.01)
    assert m["tok_s_per_user"] == pytest.approx((10.0 + 50 / 15) / 2, abs=0.01)
    assert m["hit_rate"] == pytest.approx(80 / 320) and m["refused"] == 1


@pytest.mark.parametrize("retention", [True, False])
def test_a_paused_session_keeps_its_context_through_other_traffic(retention: bool) -> None:
    """kvgate's retention hints in the simulator (router.session_retention): a session's turn
    ends with its context held on its engine for the learned gap (the default before any gap
    is seen), so one-off requests filling the engine during the tool call evict around it;
    without, they evict it and the next turn computes it again."""
    from dataclasses import replace

    small = EngineProfile(num_gpu_blocks_override=80, block_size=16)
    first = replace(req(0.0, range(40), out=16), session_id="s")
    then = replace(req(0.0, range(41), out=8), session_id="s", think_s=15.0)
    others = tuple(req(2.0 + i * 0.5, range(1000 + 20 * i, 1010 + 20 * i)) for i in range(20))
    trace = Trace("t", 16, (first, *others, then)).looped()
    done = simulate(
        trace, seed_policy(), SimConfig(nodes=1, profile=small, session_retention=retention)
    )
    second = next(d for d in done if d.request.session_id == "s" and d.request.think_s)
    assert second.cached_tokens == (40 * 16 if retention else 0)


def test_agentic_peers_are_tuned_by_the_routing_benchmarks_rule() -> None:
    """A tuned peer's point: among the grid points within 2 % of the best tokens per GPU, the
    lowest TTFT p99 — not a faster tail bought with throughput; where its defaults win, their
    runs stand."""
    from analytics.sim.agentictuned import tune_peers
    from router.decision.policies import grid_points

    trace = Trace("t", 16, (req(0.0, range(4)),))
    scores = {  # (tokens per GPU, TTFT p99) per vllm_kv_aware threshold
        2000: (30.0, 9.0),  # its default
        500: (27.0, 2.0),  # the fastest tail, 10 % less throughput: not chosen
        8000: (29.8, 5.0),
    }

    def run(t: Trace, settings: RouterSettings, rep: int) -> dict[str, Any]:
        gpu, p99 = scores[int(settings.policy_params["kv_aware_threshold"])]
        return {"seed": rep, "tok_s_per_gpu": gpu, "ttft_p99_s": p99 + rep, "hit_rate": 0.5}

    default = grid_points("vllm_kv_aware")[0]
    settings = RouterSettings(policy="vllm_kv_aware", policy_params=default)
    defaults = {"vllm_kv_aware": [run(trace, settings, rep) for rep in (0, 1)]}
    runs, chosen = tune_peers(("vllm_kv_aware",), [trace, trace], defaults, run)
    assert chosen["vllm_kv_aware"]["best"] == {"kv_aware_threshold": 8000}
    assert [r["ttft_p99_s"] for r in runs["vllm_kv_aware+tuned"]] == [5.0, 6.0]
    scores[8000] = (29.8, 12.0)  # now the defaults win: their runs are the tuned peer's
    runs, chosen = tune_peers(("vllm_kv_aware",), [trace, trace], defaults, run)
    assert chosen["vllm_kv_aware"]["best"] == default
    assert runs["vllm_kv_aware+tuned"] == defaults["vllm_kv_aware"]


def test_the_concurrency_sweep_reuses_runs_and_takes_medians() -> None:
    """Every router at every share of the sessions, the runs already made not made again, and
    per router the median of each figure."""
    from analytics.sim.agenticsweep import SWEEP_SHARES, sweep_concurrency, sweep_markdown

    made: list[tuple[int, str]] = []

    def schedule(slots: int) -> Trace:
        return Trace(f"{slots}", 16, (req(0.0, range(slots)),))

    def run(t: Trace, settings: RouterSettings) -> dict[str, Any]:
        slots = int(t.name)
        made.append((slots, settings.policy))
        p99 = float(slots) if settings.policy == "kvgate" else 2.0 * slots
        return {"hit_rate": 0.5, "ttft_p99_s": p99, "tok_s_per_gpu": 1.0, "tok_s_per_user": 1.0}

    tuned = {"dynamo_cost": {"best": {"prefill_load_scale": 2.0}}}
    known = {
        8: {
            "kvgate": {
                "hit_rate": 0.9,
                "ttft_p99_s": 1.0,
                "tok_s_per_gpu": 3.0,
                "tok_s_per_user": 2.0,
            }
        }
    }
    sweep = sweep_concurrency(10, schedule, tuned, run, known)
    assert list(sweep["runs"]) == [str(round(s * 10)) for s in SWEEP_SHARES]
    assert (8, "kvgate") not in made and (8, "dynamo_cost") in made
    assert len(made) == 3 * len(SWEEP_SHARES) - 1
    assert sweep["medians"]["kvgate"]["ttft_p99_s"] == 7.0  # 6, 7, 1 (known), 9, 10
    assert sweep["medians"]["dynamo_cost+tuned"]["ttft_p99_s"] == 16.0
    assert "| median |" in sweep_markdown(sweep)
