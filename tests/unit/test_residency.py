"""Resident sessions (router/decision/residency.py): long-context sessions placed by the
contexts already living on each node, and kept on the node holding their context."""

from dataclasses import replace

from router.decision.policies.cost import CompletionCostPolicy
from router.decision.residency import Residency
from router.decision.types import NodeView, RouteRequest
from router.decision.weights import CostWeights
from router.flow.sessions import SessionKeeper
from router.parse import parse_request
from router.settings import RouterSettings
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
    r.commit(1, "a", 50_000, NOW + 100)
    r.commit(2, "a", 70_000, NOW + 101)
    r.commit(1, "b", 60_000, NOW + 102)  # session 1 moved: it leaves a
    assert (r.tokens_on("a"), r.tokens_on("b")) == (70_000, 60_000)
    r.expire(NOW + 101.5)  # session 2's time ran out (its end never came back)
    assert (r.tokens_on("a"), r.tokens_on("b"), len(r)) == (0, 60_000, 1)
    for s in (3, 4, 5):  # over the bound: the least recent goes
        r.commit(s, "c", 1_000, NOW + 200)
    assert len(r) == 3 and r.tokens_on("b") == 0 and r.tokens_on("c") == 3_000


def test_a_paused_session_counts_on_its_node_for_its_hold() -> None:
    """A turn's end extends the session's time on its node (the hold, or the window from
    the end); it never shortens it, and a pause reported from a node the session has left
    changes nothing."""
    r = Residency()
    r.commit(1, "a", 50_000, NOW + 120)  # routed at NOW, the window 120 s
    r.pause(1, "a", NOW + 400)  # its turn ended: held until NOW + 400
    r.pause(1, "a", NOW + 200)  # an earlier end does not shorten it
    r.pause(1, "b", NOW + 900)  # not where it lives
    r.expire(NOW + 399)
    assert r.tokens_on("a") == 50_000
    r.expire(NOW + 400)
    assert r.tokens_on("a") == 0 and len(r) == 0
    r.pause(1, "a", NOW + 500)  # gone: a pause does not bring it back
    assert len(r) == 0


def test_a_session_goes_where_it_has_room_and_overflows_to_the_most_committed() -> None:
    capacity = BLOCKS * 512
    r = Residency()
    r.commit(1, "a", int(0.7 * capacity), NOW + 120)
    r.commit(2, "b", int(0.5 * capacity), NOW + 120)
    r.commit(3, "c", int(0.6 * capacity), NOW + 120)
    nodes = [agent_node("a"), agent_node("b"), agent_node("c")]

    def free(_: NodeView) -> bool:
        return False

    need = int(0.45 * capacity)  # fits on b only
    assert r.place(nodes, {}, free, need, 1.0) == (nodes[1], False)
    # no node has room: the most committed takes it, the others keep their contexts
    assert r.place(nodes, {}, free, int(0.6 * capacity), 1.0) == (nodes[0], True)
    # fill 0: no room asked, the fewest resident tokens
    assert r.place(nodes, {}, free, int(0.6 * capacity), 0.0) == (nodes[1], False)
    # a session's own context does not count against its room where it lives
    assert r.place(nodes, {}, free, int(0.75 * capacity), 1.0, session=1) == (nodes[0], False)
    # a node over its limits is left out while another is not
    assert r.place(nodes, {}, lambda n: n.node_id == "b", need, 1.0) == (nodes[0], True)


def test_only_prompts_that_take_a_share_of_a_node_are_resident() -> None:
    share = CostWeights().resident_share
    nodes = [agent_node("a")]
    capacity = BLOCKS * 512
    assert int(0.11 * capacity) >= Residency.threshold(share, nodes)
    assert int(0.09 * capacity) < Residency.threshold(share, nodes)
    assert Residency.threshold(0.0, nodes) == Residency.threshold(share, []) == float("inf")
    # a long prompt is resident on nodes whose KV is large, from resident_tokens on
    big = [node_view("big", kv_blocks_total=BLOCKS * 8, block_size=512)]
    assert Residency.threshold(share, big) == share * 8 * capacity
    assert Residency.threshold(share, big, 48_000) == 48_000
    assert Residency.threshold(share, nodes, 48_000) == share * capacity  # fewer already
    assert Residency.threshold(0.0, big, 48_000) == float("inf")  # share 0: off


def test_long_contexts_spread_on_nodes_with_much_kv() -> None:
    """Nodes with eight times the KV: a 56k-token first turn is under a tenth of a node, so
    by its share alone it is priced as a chat turn and every new session piles onto the
    holder of the system prompt it shares; from ``resident_tokens`` on it is placed by room."""
    nodes = [node_view(f"n{i}", kv_blocks_total=BLOCKS * 8, block_size=512) for i in range(4)]
    system = {"n0": 40}
    for tokens, want in ((CostWeights().resident_tokens, 4), (0, 1)):
        p = policy(resident_tokens=tokens)
        placed = {take(p, turn(f"s{i}", 110, f"r{i}"), nodes, system).chosen for i in range(4)}
        assert len(placed) == want


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


def test_a_later_turn_whose_context_is_gone_is_placed_again() -> None:
    """Its home evicted the context: what it still holds is the prefix every session shares,
    which other nodes hold as deep. The turn is placed as a first turn is (room first), not
    sent to the first of those holders."""
    p = policy()
    nodes = [agent_node("a"), agent_node("b"), agent_node("c")]
    take(p, turn("agent", 180, "t1"), nodes, {})
    home = p.sessions.homes[hash("agent")]
    others = [n.node_id for n in nodes if n.node_id != home]
    take(p, turn("other", 400, "t2"), [n for n in nodes if n.node_id == others[0]], {})
    shared = {n.node_id: 40 for n in nodes}  # the system prompt, on every node
    d = p.decide(turn("agent", 200, "t3"), nodes, shared, NOW)
    # the home has room (its own context no longer counts against it), the other with 400
    # blocks resident has less
    assert (d.chosen, d.reason) == (home, "session_place")
    # below resident_hold everywhere (nothing but the shared prefix): placed too
    d = p.decide(turn("agent", 200, "t4"), nodes, {others[1]: 20}, NOW)
    assert d.reason == "session_place"


def test_sessions_beyond_the_clusters_kv_overflow_to_one_node() -> None:
    """Three nodes each hold about two 400-block contexts: the seventh session goes to the
    node most committed already, not onto one whose contexts still fit."""
    p = policy()
    nodes = [agent_node(f"n{i}") for i in range(3)]
    placed = [take(p, turn(f"s{i}", 400, f"r{i}"), nodes, {}) for i in range(6)]
    assert {d.reason for d in placed} == {"session_place"}
    assert sorted(d.chosen or "" for d in placed) == ["n0", "n0", "n1", "n1", "n2", "n2"]
    p.sessions.residency.commit(hash("s0"), "n0", 430 * 512, NOW + 120)  # s0's context grew
    d = take(p, turn("s6", 400, "r6"), nodes, {})
    assert (d.chosen, d.reason) == ("n0", "session_overflow")


def test_an_overflow_passes_over_a_node_whose_queue_is_long() -> None:
    """Where no node has room the session overflows to the most committed node, but not
    onto a queue that takes longer than ``resident_overflow_wait_s`` to clear: then to the
    most committed of the others (0: the most committed whatever its queue)."""
    nodes = [agent_node(f"n{i}") for i in range(3)]
    for wait_s, chosen in ((30.0, "n1"), (0.0, "n0")):
        p = policy(resident_overflow_wait_s=wait_s)
        for i in range(6):
            take(p, turn(f"s{i}", 400, f"r{i}"), nodes, {})
        p.sessions.residency.commit(hash("s0"), "n0", 430 * 512, NOW + 120)
        # n0's queued prefill: 40 s at the configured 25,000 tokens/s
        busy = [replace(nodes[0], prefill_backlog_tokens=1_000_000), *nodes[1:]]
        d = take(p, turn("s6", 400, "r6"), busy, {})
        assert (d.chosen, d.reason) == (chosen, "session_overflow"), wait_s


def overflowed(**over: object) -> CompletionCostPolicy:
    """n0 holds more resident contexts than its KV (an overflow node) and ``s0`` lives there;
    n1 is nearly full, n2 has room."""
    p = policy(**over)
    res = p.sessions.residency
    res.commit(hash("s0"), "n0", 500 * 512, NOW + 120)
    res.commit(hash("s1"), "n0", 400 * 512, NOW + 120)
    res.commit(hash("s2"), "n1", 700 * 512, NOW + 120)
    p.sessions.homes[hash("s0")] = "n0"
    return p


def test_a_turn_leaves_an_overflow_node_whose_queue_is_long() -> None:
    """A later turn on an overflow node whose queue takes longer than
    ``resident_overflow_wait_s`` moves where it starts ``resident_move_gain`` × sooner: 40 s
    behind n0's queue (its context held) against 8 s computing all of it on n2."""
    nodes = [agent_node("n0", prefill_backlog_tokens=1_000_000), agent_node("n1"), agent_node("n2")]
    d = overflowed().decide(turn("s0", 400, "t"), nodes, {"n0": 400}, NOW)
    assert (d.chosen, d.reason) == ("n2", "session_move")


def test_a_turn_stays_where_moving_gains_too_little() -> None:
    """It stays on its holder: where the queue is short (20 s), where the node with room is
    queued too (40 s against 1.5 × (20 + 8) s), where the holder is not over-committed, and
    with ``resident_overflow_wait_s`` 0."""
    long_q = agent_node("n0", prefill_backlog_tokens=1_000_000)
    cases = [
        (overflowed(), [replace(long_q, prefill_backlog_tokens=500_000)]),
        (overflowed(), [long_q, agent_node("n2", prefill_backlog_tokens=500_000)]),
        (policy(), [long_q, agent_node("n2")]),
        (overflowed(resident_overflow_wait_s=0.0), [long_q, agent_node("n2")]),
    ]
    for p, given in cases:
        p.sessions.homes[hash("s0")] = "n0"
        by_id = {n.node_id: n for n in (long_q, agent_node("n1"), agent_node("n2"), *given)}
        d = p.decide(turn("s0", 400, "t"), list(by_id.values()), {"n0": 400}, NOW)
        assert (d.chosen, d.reason) == ("n0", "prefix_hit"), given


def test_a_turn_does_not_move_onto_contexts_that_would_be_kept() -> None:
    """The only other node is nearly full (700 of 842 blocks resident, no overflow): the turn
    would evict contexts kept there, so it stays in the overflow node's queue."""
    nodes = [agent_node("n0", prefill_backlog_tokens=1_000_000), agent_node("n1")]
    d = overflowed().decide(turn("s0", 400, "t"), nodes, {"n0": 400}, NOW)
    assert (d.chosen, d.reason) == ("n0", "prefix_hit")


def test_the_relief_counts_other_routers_requests_in_a_nodes_queue() -> None:
    """With several routers, a node's queue is mostly other routers' turns: this router's own
    backlog on n0 is empty, but its heartbeat shows 30 requests waiting, at this router's
    average uncached prompt (30,000 tokens) 36 s of prefill — the queue the cost counts. A
    session overflows past it, and a turn kept there moves off it."""
    busy = [agent_node("n0", waiting=30), agent_node("n1"), agent_node("n2")]
    for avg, chosen in ((30_000.0, "n1"), (2048.0, "n0")):  # 2,048: 2.5 s queued there
        p = policy()
        for i in range(6):
            take(p, turn(f"s{i}", 400, f"r{i}"), busy, {})
        p.sessions.residency.commit(hash("s0"), "n0", 430 * 512, NOW + 120)
        p.model.avg_uncached = avg
        d = take(p, turn("s6", 400, "r6"), busy, {})
        assert (d.chosen, d.reason) == (chosen, "session_overflow"), avg
    p = overflowed()
    p.model.avg_uncached = 30_000.0
    queued = [agent_node("n0", waiting=30), agent_node("n1"), agent_node("n2")]
    d = p.decide(turn("s0", 400, "t"), queued, {"n0": 400}, NOW)
    assert (d.chosen, d.reason) == ("n2", "session_move")


def test_a_subagent_starts_where_its_parent_lives() -> None:
    nodes = [agent_node("a"), agent_node("b")]
    p = policy()
    take(p, turn("parent", 150, "t1"), nodes, {})
    parent_node = p.sessions.homes[hash("parent")]
    sub = replace(turn("sub-1", 160, "t2"), parent_session_id="parent")
    d = p.decide(sub, nodes, {parent_node: 150}, NOW)
    assert d.chosen == parent_node and d.reason == "prefix_hit"


def test_the_end_of_a_turn_reaches_the_policy_through_the_session_keeper() -> None:
    """The live router's end of a turn (SessionKeeper.ended: the proxy, the gateway and the
    endpoint picker call it) tells the policy: a resident session counts on its node for its
    hold, past the window from its routing."""
    p = policy(resident_window_s=30.0)
    nodes = [agent_node("a"), agent_node("b")]
    node = take(p, turn("agent", 150, "t1"), nodes, {}).chosen
    assert node is not None
    keeper = SessionKeeper(RouterSettings(session_hold_default_s=600.0), p)
    body = b'{"model": "m", "prompt": "x", "session_id": "agent"}'
    hold = keeper.ended(parse_request(body, False, 16), "t", node, True, 10, NOW + 20)
    assert hold is not None and hold.until == NOW + 620
    p.sessions.residency.expire(NOW + 600)  # well past the routing's window of 30 s
    assert p.sessions.residency.tokens_on(node) == 150 * 512
    p.sessions.residency.expire(NOW + 620)
    assert p.sessions.residency.tokens_on(node) == 0
