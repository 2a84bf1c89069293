"""Resident sessions (router/decision/residency.py): long-context sessions placed by the
contexts already living on each node, and kept on the node holding their context."""

from dataclasses import replace

from router.decision.policies.cost import CompletionCostPolicy
from router.decision.residency import Residency
from router.decision.types import NodeView, RouteRequest
from router.decision.weights import CostWeights
from tests.factories import node_view, take

NOW = 1000.0
BLOCKS = 842  # an agent's node: a few 100k-token contexts of 512-token blocks


def agent_node(nid: str, **kw: object) -> NodeView:
    return node_view(nid, kv_blocks_total=BLOCKS, block_size=512, **kw)


def turn(session: str, blocks: int, rid: str) -> RouteRequest:
    return RouteRequest(
        rid,
        "m",
        list(range(blocks)),
        prompt_tokens=blocks * 512,
        max_tokens=256,
        session_id=session,
    )


def policy(**over: object) -> CompletionCostPolicy:
    return CompletionCostPolicy(
        CostWeights().model_copy(update=over), max_kv_used_ratio=1.0, max_queue=64
    )


def test_the_count_follows_turns_moves_and_quiet_sessions() -> None:
    r = Residency(limit=3)
    r.commit(1, "a", 50_000, NOW)
    r.commit(2, "a", 70_000, NOW + 1)
    r.commit(1, "b", 60_000, NOW + 2)  # session 1 moved: it leaves a
    assert (r.tokens_on("a"), r.tokens_on("b")) == (70_000, 60_000)
    r.expire(NOW + 100, window_s=98.5)  # session 2 quiet since NOW + 1
    assert (r.tokens_on("a"), r.tokens_on("b"), len(r)) == (0, 60_000, 1)
    for s in (3, 4, 5):  # over the bound: the least recent goes
        r.commit(s, "c", 1_000, NOW + 100)
    assert len(r) == 3 and r.tokens_on("b") == 0 and r.tokens_on("c") == 3_000


def test_only_prompts_that_take_a_share_of_a_node_are_resident() -> None:
    share = CostWeights().resident_share
    nodes = [agent_node("a")]
    capacity = BLOCKS * 512
    assert int(0.11 * capacity) >= Residency.threshold(share, nodes)
    assert int(0.09 * capacity) < Residency.threshold(share, nodes)
    assert Residency.threshold(0.0, nodes) == Residency.threshold(share, []) == float("inf")


def test_a_chat_turn_of_a_session_is_not_counted_as_resident() -> None:
    """Short turns of sessions get homes, never a share of a node's resident tokens."""
    p = policy()
    nodes = [agent_node("a"), agent_node("b")]
    chat = take(p, turn("chat", 2, "c1"), nodes, {}).chosen
    assert chat is not None and p.sessions.homes[hash("chat")] == chat
    assert len(p.sessions.residency) == 0
    agent = take(p, turn("agent", 110, "a1"), nodes, {}).chosen
    assert agent is not None and p.sessions.residency.tokens_on(agent) == 110 * 512


def test_new_sessions_spread_by_their_contexts_not_by_the_shared_system_prompt() -> None:
    """Every session's first turn shares a system prompt that one node holds: a chat turn
    goes there (its hit); a resident session's first turn goes where the fewest resident
    tokens live, and the next new session goes elsewhere."""
    nodes = [agent_node(f"n{i}") for i in range(4)]
    system = {"n0": 40}  # 40 of the prompt's 110 blocks: the shared system prompt
    p = policy()
    placed = [take(p, turn(f"s{i}", 110, f"r{i}"), nodes, system).chosen for i in range(4)]
    assert sorted(placed) == ["n0", "n1", "n2", "n3"]
    assert placed[0] == "n0"  # ties go to the holder of more of the prompt
    # without residency the shared prefix decides: all four pile onto its holder
    off = policy(resident_share=0.0)
    assert {take(off, turn(f"s{i}", 110, f"r{i}"), nodes, system).chosen for i in range(4)} == {
        "n0"
    }


def test_a_later_turn_stays_on_its_context_when_the_holder_is_busy() -> None:
    """The holder has 40 s of prefill queued: the cost would recompute the 100k-token context
    on an idle node (``spread``); a resident session's turn stays and queues behind it."""
    busy = agent_node("home", waiting=6, running=3, prefill_backlog_tokens=1_000_000)
    nodes = [busy, agent_node("idle")]
    for p, want, reason in (
        (policy(), "home", "prefix_hit"),
        (policy(resident_share=0.0), "idle", "spread"),
    ):
        take(p, turn("agent", 180, "t1"), [busy], {"home": 0})  # its first turn went home
        d = p.decide(turn("agent", 200, "t2"), nodes, {"home": 180}, NOW)
        assert (d.chosen, d.reason) == (want, reason)


def test_a_later_turn_whose_context_is_gone_goes_by_the_cost() -> None:
    """Below ``resident_hold`` of the prompt held anywhere (the context was evicted), nothing
    is kept: the cost decides as for any request."""
    p = policy()
    nodes = [agent_node("a", waiting=6, running=3, prefill_backlog_tokens=1_000_000)]
    nodes.append(agent_node("b"))
    take(p, turn("agent", 180, "t1"), nodes[:1], {})
    d = p.decide(turn("agent", 200, "t2"), nodes, {"a": 20}, NOW)
    assert d.chosen == "b" and d.reason == "spread"


def test_a_subagent_starts_where_its_parent_lives() -> None:
    nodes = [agent_node("a"), agent_node("b")]
    p = policy()
    take(p, turn("parent", 150, "t1"), nodes, {})
    parent_node = p.sessions.homes[hash("parent")]
    sub = replace(turn("sub-1", 160, "t2"), parent_session_id="parent")
    d = p.decide(sub, nodes, {parent_node: 150}, NOW)
    assert d.chosen == parent_node and d.reason == "prefix_hit"
