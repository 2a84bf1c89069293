"""Hand-checked scenarios for kvgate's completion-cost policy."""

import math
from dataclasses import replace

import pytest

from router.control import apply_weights, weights_message
from router.decision.policies.cost import CompletionCostPolicy
from router.decision.types import NodeView, RouteRequest
from router.decision.weights import CostWeights
from tests.factories import take
from tests.unit.test_policy import NOW, node

W = CostWeights()


def policy(**over: object) -> CompletionCostPolicy:
    return CompletionCostPolicy(W.model_copy(update=over), max_kv_used_ratio=0.9, max_queue=8)


LONG = RouteRequest("r1", "m", list(range(100)), prompt_tokens=1_600, max_tokens=16)


def big(nid: str, used: int = 0, **kw: object) -> NodeView:
    """A node with room for ten LONG prompts (1,000 blocks)."""
    return node(nid, used=used, kv_blocks_total=1000, **kw)


def test_a_cached_prefix_is_a_discount_on_prefill() -> None:
    d = policy().decide(LONG, [node("a"), node("b")], {"b": 60}, NOW)
    assert d.chosen == "b" and d.reason == "prefix_hit"
    parts = {c.node_id: c.components for c in d.candidates}
    rate, weight = W.prefill_tokens_per_s, W.prefill_weight
    assert parts["a"]["prefill_s"] == pytest.approx(weight * 1_600 / rate)
    assert parts["b"]["prefill_s"] == pytest.approx(weight * (1_600 - 60 * 16) / rate)
    # queueing and decode do not depend on the hit (KV need does: held blocks are reused)
    for key in ("queue_s", "decode_s"):
        assert parts["a"][key] == parts["b"][key]


def test_the_holder_over_its_kv_limit_is_not_chosen_unless_the_request_waits_there() -> None:
    """Over its KV limit, a holder is passed over for a request that needs many new blocks
    there; one that needs few (at most router/decision/fit.py QUEUE_SHARE of its blocks) waits
    there for them and is priced, not refused (the cost's KV pressure)."""
    longer = RouteRequest("r2", "m", list(range(200)), prompt_tokens=3_200, max_tokens=16)
    d = policy().decide(longer, [big("a"), big("b", used=950)], {"b": 50}, NOW)  # 150 new
    assert d.chosen == "a" and d.reason == "overload_fallback"
    d = policy().decide(longer, [big("a"), big("b", used=950)], {"b": 150}, NOW)  # 50 new
    assert d.reason == "spread"  # not over its limits: its KV pressure outweighed the hit


def test_a_full_node_still_takes_a_request_that_hits_there_and_needs_few_blocks() -> None:
    """The KV limit applies to the request's new blocks: a holder whose running requests fill
    its KV (997 of 1,000 blocks) takes a request that hits there and needs few new blocks (1,
    or 5: more than the 3 free, the engine queues it until its running requests free them),
    where a ratio test would have sent it to a node that must prefill the whole prompt; a
    request that would need many new blocks (more than QUEUE_SHARE of the node's) does not go
    there. (The rule alone: the KV-pressure cost term is off here.)"""
    p = CompletionCostPolicy(W.model_copy(update={"kv_pressure_s": 0.0}), 1.0, max_queue=8)
    full = big("b", used=997)
    for hit in (100, 95):
        d = p.decide(LONG, [big("a", used=400), full], {"b": hit}, NOW)
        assert d.chosen == "b" and d.reason == "prefix_hit"
    longer = RouteRequest("r2", "m", list(range(200)), prompt_tokens=3_200, max_tokens=16)
    d = p.decide(longer, [big("a", used=400), full], {"b": 50}, NOW)  # 150 new blocks
    assert d.chosen == "a" and d.reason == "overload_fallback"


def test_a_hot_prefix_spreads_when_its_holder_is_backed_up() -> None:
    busy_holder = big("b", prefill_backlog_tokens=200_000)
    d = policy().decide(LONG, [big("a"), busy_holder], {"b": 60}, NOW)
    assert d.chosen == "a" and d.reason == "spread"


def test_on_a_saturated_cluster_a_copy_pays_for_the_requests_queued_behind_it() -> None:
    """Every node has 4 requests waiting: a miss's prefill delays the requests behind it, so a
    holder backed up by a little more than the others keeps the followers of its prefix (the
    selfish cost, ``congestion`` 0, would copy the prefix: a second prefill on a cluster with no
    node free — the cascade of copies that halves a loaded cluster's capacity). A prefix asked
    for by more than its holder's share of the traffic is still copied: the copy relieves its
    holder. With a node free, no copy delays anyone."""

    def cluster(waiting_a: int = 4) -> list[NodeView]:
        return [big("a", waiting=waiting_a), big("b", waiting=4, prefill_backlog_tokens=12_000)]

    assert policy(congestion=0.0).decide(LONG, cluster(), {"b": 60}, NOW).reason == "spread"
    d = policy().decide(LONG, cluster(), {"b": 60}, NOW)
    assert d.chosen == "b" and d.reason == "prefix_hit"
    parts = {c.node_id: c.components for c in d.candidates}
    for nid, uncached in (("a", 1_600), ("b", 1_600 - 960)):
        assert parts[nid]["congestion_s"] == pytest.approx(4 * uncached / W.prefill_tokens_per_s)
    hot = replace(LONG, prefix_share=0.5)  # × 2 nodes: one holder carries all it should
    d = policy().decide(hot, cluster(), {"b": 60}, NOW)
    assert d.chosen == "a" and d.reason == "spread"
    assert all(c.components["congestion_s"] == 0.0 for c in d.candidates)
    d = policy().decide(LONG, cluster(waiting_a=0), {"b": 60}, NOW)
    assert all(c.components["congestion_s"] == 0.0 for c in d.candidates)


def test_a_lagging_index_cannot_attract_traffic() -> None:
    fresh, stale = policy(), policy()
    holder = big("b", kv_index_gap=3, kv_index_age_s=0.0)
    assert fresh.decide(LONG, [big("a"), holder], {"b": 100}, NOW).chosen == "b"
    lagging = big("b", kv_index_gap=3, kv_index_age_s=10.0, running=2)
    d = stale.decide(LONG, [big("a"), lagging], {"b": 100}, NOW)
    conf = {c.node_id: c.components["confidence"] for c in d.candidates}
    expected = math.exp(-(10.0 - W.stale_grace_s) / W.stale_tau_s)
    assert conf["b"] == pytest.approx(expected) and conf["a"] == 1.0
    assert d.chosen == "a"


def test_a_sessions_home_does_not_outweigh_a_prefix_held_elsewhere() -> None:
    """A session's home gets its bonus only where no other node holds more of the prompt: a
    node holding the prompt's prefix (another bot's system prompt) is worth more than the node
    the session's hash names, or the node its last turn went to, however small the prefill it
    saves. (Chat-sized nodes: a 160-token prompt is far from a resident session's share of
    their KV.)"""
    nodes = [node(f"n{i}", kv_blocks_total=10_000) for i in range(8)]
    short = RouteRequest("r", "m", list(range(10)), prompt_tokens=160, max_tokens=8)
    ring = policy().decide(replace(short, session_id="chat-42"), nodes, {}, NOW).chosen
    other = next(n.node_id for n in nodes if n.node_id != ring)
    # the prefill it saves (8 of 10 blocks at 25,000 tokens/s) is less than the 0.1 s bonus
    d = policy().decide(replace(short, session_id="chat-42"), nodes, {other: 8}, NOW)
    assert d.chosen == other and d.reason == "prefix_hit"
    assert all(c.components["affinity_s"] == 0.0 for c in d.candidates)
    p = policy()
    take(p, replace(short, session_id="chat-7"), nodes, {})  # its first turn: a home
    home = p.sessions.homes[hash("chat-7")]
    other = next(n.node_id for n in nodes if n.node_id != home)
    d = p.decide(replace(short, session_id="chat-7"), nodes, {other: 8}, NOW)
    assert d.chosen == other and d.reason == "prefix_hit"
    d = p.decide(replace(short, session_id="chat-7"), nodes, {other: 8, home: 8}, NOW)
    assert d.chosen == home  # as much there: the conversation's node


def test_session_affinity_is_shared_by_replicas_and_yields_to_load() -> None:
    nodes = [node(f"n{i}") for i in range(8)]
    homes = set()
    for replica in range(3):  # three independent router replicas
        p = policy()
        for turn in range(3):
            req = RouteRequest(
                f"r{replica}{turn}", "m", [], prompt_tokens=40, max_tokens=8, session_id="chat-42"
            )
            d = take(p, req, nodes, {})
            homes.add(d.chosen)
            assert d.reason == "session_home"
    assert len(homes) == 1
    home = homes.pop()
    loaded = [node(n.node_id, running=40, waiting=6) if n.node_id == home else n for n in nodes]
    req = RouteRequest("r9", "m", [], prompt_tokens=40, max_tokens=8, session_id="chat-42")
    assert policy().decide(req, loaded, {}, NOW).chosen != home


def test_a_session_keeps_the_home_its_last_turn_went_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ring home of a session is its home until it has a turn somewhere: from then on the
    node of its last turn (which holds its context) is, even once the ring's node is free
    again; a home that left the candidates gives way to the ring's."""
    nodes = [node(f"n{i}") for i in range(8)]

    def turn(p: CompletionCostPolicy, i: int, among: list[NodeView]) -> str | None:
        req = RouteRequest(f"t{i}", "m", [], prompt_tokens=40, max_tokens=8, session_id="chat-7")
        d = take(p, req, among, {})
        assert d.reason == "session_home"
        return d.chosen

    ring = turn(policy(), 0, nodes)
    p = policy()
    busy = [node(n.node_id, pending=40) if n.node_id == ring else n for n in nodes]
    req = RouteRequest("t1", "m", [], prompt_tokens=40, max_tokens=8, session_id="chat-7")
    first = take(p, req, busy, {}).chosen
    assert first != ring
    assert turn(p, 2, nodes) == first  # the ring's node is free again: the session stays
    assert turn(p, 3, [n for n in nodes if n.node_id != first]) == ring
    monkeypatch.setattr("router.decision.sessionplaces.SESSION_HOMES", 2)
    for i in range(3):  # the least recent sessions are forgotten first
        take(p, RouteRequest(f"o{i}", "m", [], 40, 8, session_id=f"other-{i}"), nodes, {})
    assert hash("chat-7") not in p.sessions.homes and len(p.sessions.homes) == 2


def test_deciding_learns_nothing_only_a_commit_does() -> None:
    """A dry run, a held request's polls, a decision not taken: the session's home and the
    average uncached prompt stay as they were until the request is really sent."""
    p = policy()
    nodes = [node(f"n{i}") for i in range(4)]
    req = RouteRequest("s1", "m", [], prompt_tokens=4000, max_tokens=8, session_id="chat-9")
    before = p.model.avg_uncached
    for _ in range(20):
        p.decide(req, nodes, {}, NOW)
    assert p.sessions.homes == {} and p.model.avg_uncached == before
    d = take(p, req, nodes, {})
    assert p.sessions.homes == {hash("chat-9"): d.chosen} and p.model.avg_uncached != before


def test_heartbeat_load_is_smoothed() -> None:
    p = policy()
    a = node("a", running=0, heartbeat_ts=NOW - 1)
    p.decide(LONG, [a], {}, NOW)
    spike = node("a", running=100, heartbeat_ts=NOW - 0.5)
    p.decide(LONG, [spike], {}, NOW)
    assert p.model.smooth["a"].running == pytest.approx(100 * W.load_ewma)
    p.decide(LONG, [spike], {}, NOW)  # the same heartbeat again: no second update
    assert p.model.smooth["a"].running == pytest.approx(100 * W.load_ewma)


def test_weights_change_at_runtime_only_forward_and_only_when_valid() -> None:
    p = policy()
    assert p.weights_version == 1
    newer = W.model_copy(update={"version": 2, "prefill_weight": 1.5}).model_dump()
    assert apply_weights(p, weights_message("kvgate", newer)) == "applied"
    assert p.weights_version == 2 and p.w.prefill_weight == 1.5
    assert apply_weights(p, weights_message("kvgate", {**newer, "prefill_weight": 9})) == (
        "not_newer"
    )
    bad = {**newer, "version": 3, "prefill_weight": -1}
    assert apply_weights(p, weights_message("kvgate", bad)).startswith("invalid")
    assert p.weights_version == 2 and p.w.prefill_weight == 1.5
    assert apply_weights(p, weights_message("seed_score", {"version": 9})) == "other_policy"
    d = p.decide(LONG, [node("a")], {}, NOW)
    assert d.chosen == "a" and p.weights_version == 2


def test_the_fast_total_equals_the_recorded_components() -> None:
    p = policy(interference=0.2)
    nodes = [
        node("a", used=50, running=3, waiting=1, pending=2, prefill_backlog_tokens=900),
        node("b", used=95, running=9, waiting=3, kv_index_gap=2, kv_index_age_s=3.0),
        node("c", kv_blocks_total=0, waiting=2),
    ]
    req = RouteRequest(
        "r",
        "m",
        list(range(40)),
        prompt_tokens=700,
        max_tokens=300,
        session_id="s1",
        prefix_share=0.2,
    )
    matches = {"a": 10, "b": 40}
    take(p, req, nodes, matches)  # smoothing state settles on these heartbeats
    home: str | None = p.sessions.homes[hash("s1")]  # the node of the session's last turn
    if matches.get(home or "", 0) < max(matches.values()):
        home = None  # another node holds more of the prompt: no bonus
    floor = p.model.congestion(req, nodes, matches)
    assert 0 < floor < 2  # the least queued node's 2, less the share a copy would relieve
    expected = {
        n.node_id: -p.model.total(req, n, matches.get(n.node_id, 0), home, floor) for n in nodes
    }
    d = p.decide(req, nodes, matches, NOW)
    assert {c.node_id: c.score for c in d.candidates} == pytest.approx(expected)
