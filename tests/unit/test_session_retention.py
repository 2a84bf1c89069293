"""Agent sessions between turns: the learned inter-turn gap, the holds on paused sessions, and
the simulated engine keeping a hinted session's prefix through other traffic (and letting it go
when its hold ends or running work needs the room)."""

from __future__ import annotations

import random

import pytest

from agents.kvcache import KvCache
from agents.profile import EngineProfile
from agents.scheduler import EngineCore, Sequence
from agents.simfaults import retention_ttl
from router.decision.turngap import Hold, PausedSessions, TurnGaps
from router.parse import parse_request

KIND = ("alpha", "m")


def test_the_bound_is_learned_from_the_gaps_between_turns() -> None:
    gaps = TurnGaps(min_samples=8, default_s=60.0, floor_s=1.0, ceiling_s=600.0)
    assert gaps.bound(KIND) == 60.0  # nothing seen: the default
    assert gaps.began("s", KIND, 0.0) is None  # a first turn has no gap
    now = 0.0
    rng = random.Random(3)
    for _ in range(40):  # tool calls of 8-12 s
        gaps.ended("s", KIND, now)
        now += rng.uniform(8.0, 12.0)
        assert gaps.began("s", KIND, now) is not None
    bound = gaps.bound(KIND)
    assert 12.0 <= bound <= 12.0 * 1.25 * 1.2  # the 90th percentile's bucket, with its margin
    assert gaps.bound(("beta", "m")) == 60.0  # another tenant's sessions learn on their own
    gaps.ended("s", KIND, now)
    assert gaps.began("s", ("alpha", "other-model"), now + 5) is None  # another kind's turn
    assert gaps.report()["alpha/m"]["gaps_seen"] == 40


def test_long_pauses_move_the_bound_up_within_its_ceiling() -> None:
    gaps = TurnGaps(min_samples=4, decay=0.9, ceiling_s=300.0)
    now = 0.0
    for gap in [5.0] * 10 + [400.0] * 30:  # the sessions' tools got slow
        gaps.ended("s", KIND, now)
        now += gap
        gaps.began("s", KIND, now)
    assert gaps.bound(KIND) == 300.0


def test_a_hold_ends_with_the_next_turn_or_its_bound() -> None:
    paused = PausedSessions()
    paused.pause(Hold("a", "n1", 40, until=10.0))
    paused.pause(Hold("b", "n1", 10, until=20.0))
    paused.pause(Hold("c", "n2", 5, until=30.0))
    assert paused.blocks_by_node() == {"n1": 50, "n2": 5}
    assert paused.resume("a", 5.0) == Hold("a", "n1", 40, 10.0)  # back within its hold
    assert [h.session for h in paused.expire(25.0)] == ["b"]
    assert paused.resume("c", 31.0) is None  # came back after its bound: nothing held
    assert len(paused) == 0


def test_held_blocks_yield_and_expire() -> None:
    cache = KvCache(num_blocks=6, block_size=4)
    cache.allocate(3)
    cache.commit([1, 2, 3], None, list(range(12)))
    cache.release([1, 2, 3], 0, hold_until=100.0)  # a paused session's prefix
    cache.allocate(2)
    cache.commit([7, 8], None, list(range(8)))
    cache.release([7, 8], 0)  # ordinary unreferenced blocks
    assert cache.held_blocks == 3 and cache.free_blocks == 6
    cache.allocate(3)  # 1 empty, then the 2 ordinary ones go first
    assert cache.match_prefix([1, 2, 3]) == 3 and cache.match_prefix([7]) == 0
    cache.allocate(2)  # nothing else left: the hold yields rather than fail the allocation
    assert cache.held_blocks == 1 and cache.used_blocks == 5
    assert cache.expire(99.0) == 0 and cache.expire(100.0) == 1
    assert cache.held_blocks == 0 and cache.free_blocks == 1


def _turn(
    core: EngineCore, rid: str, prompt: list[int], retain_s: float, now: float
) -> tuple[Sequence, float]:
    s = Sequence(rid, prompt, 4, now, random.Random(1), retain_s=retain_s)
    core.add(s)
    while not core.idle:
        now += core.step(now).duration_s
    return s, now


@pytest.mark.parametrize("hinted", [True, False])
def test_a_hinted_session_keeps_its_prefix_through_other_traffic(hinted: bool) -> None:
    """Turn 1 of an agent; a tool runs while 20 other requests pass through a small cache;
    turn 2 finds turn 1's prefix only when turn 1 carried a retention hint. Past the hold the
    prefix is ordinary again and churned out like any other."""
    core = EngineCore(EngineProfile(num_gpu_blocks_override=64, block_size=4))
    agent = list(range(100_000, 100_160))  # 40 blocks
    _, now = _turn(core, "t1", agent, 30.0 if hinted else 0.0, 0.0)
    for i in range(20):  # other traffic, 10 blocks each
        _, now = _turn(core, f"x{i}", list(range(i * 1000, i * 1000 + 40)), 0.0, now)
    t2, now = _turn(core, "t2", [*agent, 1, 2, 3, 4], 0.0, now)
    assert t2.cached_tokens == (160 if hinted else 0)
    if hinted:  # turn 2 ran without a hint: its blocks are ordinary, and churn takes them
        for i in range(20):
            _, now = _turn(core, f"y{i}", list(range(50_000 + i * 1000, 50_040 + i * 1000)), 0, now)
        t3, _ = _turn(core, "t3", [*agent, 9], 0.0, now)
        assert t3.cached_tokens == 0


def test_hints_are_kvgates_to_give() -> None:
    """A client's own agent_hint never reaches an engine; an engine reads a hint's TTL only
    when it is one (bounded)."""
    body = b'{"model": "m", "prompt": "x", "agent_hint": {"cache_control": {"ttl": 3600}}}'
    assert "agent_hint" not in parse_request(body, False, 16).body
    assert retention_ttl({"agent_hint": {"cache_control": {"type": "ephemeral", "ttl": 30}}}) == 30
    for bad in (None, {}, {"agent_hint": 5}, {"agent_hint": {"cache_control": {"ttl": True}}}):
        assert retention_ttl(bad) == 0.0
    assert retention_ttl({"agent_hint": {"cache_control": {"ttl": 7200}}}) == 0.0


def test_a_session_paused_again_keeps_its_new_hold() -> None:
    """A session that resumed and paused again is not expired by its first hold's end, and
    expiry only looks at holds due (a heap, not a scan of every paused session)."""
    paused = PausedSessions()
    paused.pause(Hold("a", "n1", 4, until=10.0))
    assert paused.resume("a", 5.0) is not None
    paused.pause(Hold("a", "n2", 6, until=50.0))
    for i in range(1000):
        paused.pause(Hold(f"s{i}", "n3", 1, until=100.0 + i))
    assert paused.expire(20.0) == [] and len(paused) == 1001
    assert [h.session for h in paused.expire(60.0)] == ["a"]
    assert len(paused.expire(100.5)) == 1 and len(paused) == 999


def test_holds_end_in_the_order_they_began_while_the_bound_falls() -> None:
    """The learned bound drops (the default before enough gaps, then short tool calls): the
    holds given still end in about the order they began — the bound falls at most
    ``fall_per_s`` per second — and reach the learned bound; a rise takes at once."""
    gaps = TurnGaps(min_samples=4, default_s=60.0, floor_s=1.0, fall_per_s=0.1)
    now, ends = 0.0, []
    for _ in range(200):  # 2-3 s tool calls: the bound learned is a few seconds
        gaps.ended("s", KIND, now)
        now += 2.5
        gaps.began("s", KIND, now)
        ends.append(now + gaps.hold_s(KIND, now))
    assert ends == sorted(ends)  # a hold given later never ends earlier
    assert gaps.hold_s(KIND, now + 1e4) == gaps.bound(KIND) < 5.0  # it got there
    for _ in range(40):  # the tools got slow: the bound rises, and the holds with it at once
        gaps.ended("s", KIND, now)
        now += 90.0
        gaps.began("s", KIND, now)
    assert gaps.hold_s(KIND, now) == gaps.bound(KIND) >= 90.0


def test_held_blocks_yield_least_recently_released_first() -> None:
    """Among held blocks the engine evicts the session released longest ago, whatever the
    ends of their holds: a hold says how long a session is protected, not who returns first."""
    cache = KvCache(num_blocks=4, block_size=4)
    for h, until in ((1, 500.0), (2, 100.0)):  # the older session got the longer hold
        cache.allocate(2)
        cache.commit([h * 10, h * 10 + 1], None, list(range(8)))
        cache.release([h * 10, h * 10 + 1], 0, hold_until=until)
    cache.allocate(2)  # room for one more: a session goes, the older one
    assert cache.match_prefix([10, 11]) == 0 and cache.match_prefix([20, 21]) == 2


def test_the_simulator_keeps_a_finished_turn_for_its_hint() -> None:
    """The simulated engine of `kvgate bench`: a finished turn with a retention hint is held
    for it (from its end), then ordinary again."""
    from analytics.sim.simcore import SimCore, SimSeq

    core = SimCore(EngineProfile(num_gpu_blocks_override=64, block_size=4))
    seq = SimSeq("t1", 40, 2, list(range(1, 12)))
    seq.retain_s = 30.0
    core.add(seq)
    now = 0.0
    while not seq.finished:
        now += core.step(now).duration_s
    assert core.cache.held_blocks == 10  # the prompt's full blocks and the answer's
    core.step(now + 29.0)
    assert core.cache.held_blocks == 10
    core.step(now + 31.0)
    assert core.cache.held_blocks == 0 and core.cache.match_prefix(list(range(1, 11))) == 10
