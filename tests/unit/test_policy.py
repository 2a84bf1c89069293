from router.decision.inflight import InflightLedger
from router.decision.policies import SeedScorePolicy
from router.decision.types import RouteRequest, eligible
from router.decision.weights import SeedWeights
from streams.prefix_index import PrefixIndex
from tests.factories import NOW, take
from tests.factories import node_view as node


def policy() -> SeedScorePolicy:
    return SeedScorePolicy(SeedWeights(), max_kv_used_ratio=0.9, max_queue=8)


REQ = RouteRequest("r1", "m", [1, 2, 3, 4], prompt_tokens=64, max_tokens=16)


def test_cached_prefix_wins() -> None:
    d = policy().decide(REQ, [node("a"), node("b")], {"b": 3}, NOW)
    assert d.chosen == "b" and d.reason == "prefix_hit"
    assert {c.node_id: c.hit_blocks for c in d.candidates} == {"a": 0, "b": 3}


def test_seed_formula_values() -> None:
    d = policy().decide(REQ, [node("a", used=50, waiting=4)], {"a": 2}, NOW)
    c = d.candidates[0]
    assert abs(c.score - (0.5 * 0.5 - 0.3 * (0.5 + 0.05 * 4) + 0.1)) < 1e-12


def test_overloaded_holder_falls_back_to_best_within_limits() -> None:
    d = policy().decide(REQ, [node("a", used=95), node("b", used=10)], {"a": 4}, NOW)
    assert d.chosen == "b" and d.reason == "overload_fallback"


def test_all_overloaded_picks_least_loaded() -> None:
    d = policy().decide(REQ, [node("a", used=99), node("b", used=92, waiting=20)], {"b": 4}, NOW)
    assert d.chosen == "a" and d.reason == "all_overloaded"


def test_no_nodes() -> None:
    d = policy().decide(REQ, [], {}, NOW)
    assert d.chosen is None and d.reason == "no_healthy_node"


def test_eligible_drops_stale_unhealthy_draining_and_other_models() -> None:
    nodes = [
        node("ok"),
        node("stale", heartbeat_ts=NOW - 5),
        node("sick", healthy=False),
        node("drain", draining=True),
        node("other", model="x"),
    ]
    assert [n.node_id for n in eligible(nodes, "m", NOW)] == ["ok"]


def test_ledger_counts_unreflected_dispatches_and_spreads_a_burst() -> None:
    ledger = InflightLedger()
    chosen = []
    for i in range(4):
        nodes = [node(n, pending=ledger.unreflected(n, NOW - 0.2)) for n in ("a", "b")]
        d = policy().decide(RouteRequest(f"r{i}", "m", [], 10, 10), nodes, {}, NOW)
        assert d.chosen is not None
        ledger.dispatch(f"r{i}", d.chosen, NOW, prefill_tokens=100)
        chosen.append(d.chosen)
    assert sorted(chosen) == ["a", "a", "b", "b"]
    ledger.finish("r0")
    assert ledger.unreflected(chosen[0], NOW - 0.2) == 1
    assert ledger.unreflected(chosen[0], NOW + 1) == 0  # a newer heartbeat shows them


def test_ledger_prefill_backlog_until_first_token_and_sweep() -> None:
    ledger = InflightLedger(horizon_s=10)
    ledger.dispatch("r1", "a", NOW, 500)
    ledger.dispatch("r2", "a", NOW, 300)
    assert ledger.prefill_backlog("a") == 800
    ledger.first_token("r1")
    ledger.first_token("r1")  # idempotent
    assert ledger.prefill_backlog("a") == 300
    ledger.finish("r1")
    assert len(ledger) == 1
    assert ledger.sweep(NOW + 11) == 1  # a lost finish does not leak
    assert len(ledger) == 0 and ledger.prefill_backlog("a") == 0


def test_prefix_index_longest_contiguous_match_and_drop() -> None:
    idx = PrefixIndex()
    idx.add_many("a", [1, 2, 3])
    idx.add_many("b", [1, 3])
    assert idx.match([1, 2, 3, 4]) == {"a": 3, "b": 1}
    idx.drop_node("a")
    assert idx.match([1, 2]) == {"b": 1} and len(idx) == 2
    idx.remove("b", 1)
    assert idx.match([1]) == {} and idx.nodes() == ["b"]


def test_least_requests_counts_pending_too() -> None:
    from router.decision.policies import LeastRequestsPolicy

    d = LeastRequestsPolicy().decide(
        REQ, [node("a", running=2), node("b", running=1, pending=3)], {}, NOW
    )
    assert d.chosen == "a"


def test_power_of_two_takes_the_less_loaded_of_its_pair() -> None:
    from router.decision.policies import PowerOfTwoPolicy

    p = PowerOfTwoPolicy(seed=1)
    nodes = [node("a", running=9), node("b", running=0)]
    assert all(p.decide(REQ, nodes, {}, NOW).chosen == "b" for _ in range(10))


def test_consistent_hash_is_stable_and_moves_little_when_a_node_leaves() -> None:
    from router.decision.policies import ConsistentHashPolicy

    p = ConsistentHashPolicy()
    nodes = [node(n) for n in "abcd"]
    reqs = [RouteRequest(f"r{i}", "m", [i * 7919], 16, 8, session_id=f"s{i}") for i in range(200)]
    before = {r.session_id: p.decide(r, nodes, {}, NOW).chosen for r in reqs}
    assert before == {r.session_id: p.decide(r, nodes, {}, NOW).chosen for r in reqs}
    after = {r.session_id: p.decide(r, nodes[:3], {}, NOW).chosen for r in reqs}
    moved = [s for s in before if before[s] != after[s]]
    assert all(before[s] == "d" for s in moved)  # only the departed node's keys move
    assert len(set(before.values())) == 4


def test_every_policy_has_the_same_interface() -> None:
    from router.decision.policies import POLICIES
    from router.settings import RouterSettings

    for name, factory in POLICIES.items():
        policy = factory(RouterSettings.model_validate({"policy": name}))
        d = policy.decide(REQ, [node("a"), node("b")], {"a": 2}, NOW)
        assert policy.name == name and d.chosen in {"a", "b"}
        assert policy.decide(REQ, [], {}, NOW).chosen is None


def test_sglang_cache_aware_follows_its_own_tree_until_load_is_imbalanced() -> None:
    from router.decision.policies.peers import SglangCacheAwarePolicy

    p = SglangCacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    nodes = [node("a"), node("b")]
    first = take(p, REQ, nodes)
    assert first.reason == "smallest_tree"
    again = take(p, RouteRequest("r2", "m", [1, 2, 3, 9], 64, 16), nodes)
    assert again.chosen == first.chosen and again.reason == "prefix_hit"  # 3/4 > 0.3
    busy = [node(first.chosen, running=10), node("b" if first.chosen == "a" else "a")]
    d = p.decide(RouteRequest("r3", "m", [1, 2, 3], 48, 16), busy, {}, NOW)
    assert d.reason == "imbalanced_least_loaded" and d.chosen != first.chosen


def test_sglang_cache_aware_balances_on_its_own_requests_in_flight() -> None:
    """Attached to the router's ledger (as the live router and the simulator do), the load is
    the router's own count per worker, not the heartbeat's."""
    from router.decision.inflight import InflightLedger
    from router.decision.policies.peers import SglangCacheAwarePolicy

    p = SglangCacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    led = InflightLedger()
    p.sequences = led
    for i in range(6):
        led.dispatch(f"x{i}", "a", NOW, 16)
    # the heartbeat says b is the busy one; the router's own count says a is
    nodes = [node("a"), node("b", running=20)]
    d = p.decide(REQ, nodes, {}, NOW)
    assert d.reason == "imbalanced_least_loaded" and d.chosen == "b"
    assert {c.node_id: c.components["load"] for c in d.candidates} == {"a": 6.0, "b": 0.0}


def test_dynamo_cost_is_overlap_weighted_prefill_plus_decode_blocks() -> None:
    from router.decision.policies.peers import DynamoCostPolicy

    d = DynamoCostPolicy().decide(REQ, [node("a", used=10), node("b", used=0)], {"a": 4}, NOW)
    costs = {c.node_id: -c.score for c in d.candidates}
    assert costs == {"a": 0 + 14, "b": 4 + 4} and d.chosen == "b"


def test_dynamo_cost_counts_its_own_active_sequences_like_dynamo() -> None:
    """With the router's in-flight ledger attached (as the live router and the simulator do):
    prefill = (uncached prompt tokens of requests not past their first token + the prompt)
    / block size − overlap; decode = distinct active prompt blocks + the request's blocks not
    among them."""
    from router.decision.inflight import InflightLedger
    from router.decision.policies.peers import DynamoCostPolicy

    p = DynamoCostPolicy()
    led = InflightLedger(track_blocks=True)
    p.sequences = led
    # on a: one request still prefilling 32 tokens, sharing the request's first two blocks
    led.dispatch("x", "a", NOW, 32, hashes=[1, 2, 7])
    # on b: two finished prefills holding 6 distinct blocks
    led.dispatch("y", "b", NOW, 48, hashes=[10, 11, 12])
    led.dispatch("z", "b", NOW, 48, hashes=[13, 14, 15])
    led.first_token("y", NOW)
    led.first_token("z", NOW)
    a = node("a", prefill_backlog_tokens=led.prefill_backlog("a"))
    b = node("b", prefill_backlog_tokens=led.prefill_backlog("b"))
    d = p.decide(REQ, [a, b], {"a": 2}, NOW)  # REQ: blocks [1, 2, 3, 4], 64 tokens
    costs = {c.node_id: -c.score for c in d.candidates}
    assert costs["a"] == (32 + 64) / 16 - 2 + (3 + 4 - 2)  # 4 + 5
    assert costs["b"] == 64 / 16 + (6 + 4)  # 4 + 10
    assert d.chosen == "a"
    led.finish("x")
    assert led.active_blocks("a") == 0 and led.active_requests("a") == 0


def test_llmd_weighted_scores_prefix_queue_and_kv() -> None:
    from router.decision.policies.peers import LlmdWeightedPolicy

    d = LlmdWeightedPolicy().decide(REQ, [node("a", waiting=4), node("b", used=50)], {"a": 4}, NOW)
    parts = {c.node_id: c.components for c in d.candidates}
    assert parts["a"] == {"prefix": 3.0, "queue": 0.0, "kv": 2.0}
    assert parts["b"] == {"prefix": 0.0, "queue": 2.0, "kv": 1.0}
    assert d.chosen == "a"


def test_vllm_prefix_aware_follows_its_trie_and_ignores_load() -> None:
    from router.decision.policies.vllmstack import VllmStackPrefixAwarePolicy

    p = VllmStackPrefixAwarePolicy()
    nodes = [node("a"), node("b"), node("c")]
    first = take(p, REQ, nodes)
    assert first.reason == "random"
    # every later request sharing the first block goes where the trie says, however busy
    busy = [node(n.node_id, running=50 if n.node_id == first.chosen else 0) for n in nodes]
    for i in range(5):
        d = take(p, RouteRequest(f"r{i}", "m", [1, 2, 30 + i], 48, 16), busy)
        assert d.chosen == first.chosen and d.reason == "prefix_hit"
    # the matched endpoint gone: the deepest match among the available ones (none: random)
    rest = [n for n in nodes if n.node_id != first.chosen]
    d = p.decide(RouteRequest("r9", "m", [1, 2, 3], 48, 16), rest, {}, NOW)
    assert d.chosen != first.chosen and d.reason == "random"


def test_vllm_prefix_aware_keeps_its_trie_bounded() -> None:
    from router.decision.policies.vllmstack import VllmStackPrefixAwarePolicy

    p = VllmStackPrefixAwarePolicy(max_blocks=8)
    nodes = [node("a"), node("b")]
    for i in range(10):
        take(p, RouteRequest(f"r{i}", "m", [i * 10 + j for j in range(3)], 48, 16), nodes)
    assert len(p._trie) == 8 and 0 not in p._trie and 92 in p._trie  # the oldest went first


def test_vllm_prefix_aware_below_min_match_goes_to_lowest_routed_qps() -> None:
    from router.decision.policies.vllmstack import VllmStackPrefixAwarePolicy

    p = VllmStackPrefixAwarePolicy(min_match_blocks=3)
    nodes = [node("a"), node("b")]
    chosen = [take(p, RouteRequest(f"r{i}", "m", [i], 16, 16), nodes).chosen for i in (1, 2)]
    assert chosen == ["a", "b"]  # an endpoint never sent to first, then the lowest rate
    # requests older than the 60 s window no longer count
    d = p.decide(RouteRequest("r3", "m", [3], 16, 16), nodes, {}, NOW + 61)
    assert d.reason == "lowest_qps" and d.chosen == "a"


def test_vllm_kv_aware_uses_the_index_within_its_threshold_else_session_or_qps() -> None:
    from router.decision.policies.vllmstack import VllmStackKvAwarePolicy

    p = VllmStackKvAwarePolicy(kv_aware_threshold=32)  # tokens
    nodes = [node("a"), node("b"), node("c")]
    long = RouteRequest("r1", "m", list(range(8)), 128, 16)  # 8 blocks of 16 tokens
    d = take(p, long, nodes, {"b": 6})  # 96 cached ≥ 128 − 32
    assert d.chosen == "b" and d.reason == "prefix_hit"
    d = p.decide(long, nodes, {"b": 5}, NOW)  # 80 < 96: not enough
    assert d.reason == "lowest_qps" and d.chosen == "a"  # a was never sent to
    s1 = RouteRequest("r2", "m", list(range(8)), 128, 16, session_id="s1")
    homes = {p.decide(s1, nodes, {"b": 1}, NOW + i).chosen for i in range(3)}
    assert len(homes) == 1 and p.decide(s1, nodes, {}, NOW).reason == "session"


def test_policy_params_reach_the_peer_and_are_checked() -> None:
    import pytest

    from router.decision.policies import TUNING_GRID, grid_points, make_policy
    from router.settings import RouterSettings

    p = make_policy(RouterSettings(policy="llmd_weighted", policy_params={"prefix": 5.0}))
    assert p.w == (5.0, 2.0, 2.0)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="bad policy_params"):
        make_policy(RouterSettings(policy="dynamo_cost", policy_params={"temperature": 1.0}))
    with pytest.raises(ValueError, match="takes no policy_params"):
        make_policy(RouterSettings(policy="kvgate", policy_params={"hit": 1.0}))
    for name in TUNING_GRID:  # the grid's first point is the peer's default, and builds
        points = grid_points(name)
        assert len(points) == len({tuple(sorted(x.items())) for x in points})
        for params in points:
            make_policy(RouterSettings(policy=name, policy_params=params))
        default = make_policy(RouterSettings(policy=name))
        tuned = make_policy(RouterSettings(policy=name, policy_params=points[0]))

        def plain(p: object) -> dict[str, object]:
            return {k: v for k, v in vars(p).items() if isinstance(v, int | float | tuple)}

        assert plain(default) == plain(tuned) and plain(default)
