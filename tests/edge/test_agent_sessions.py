"""Sessions as agent clients name them: a session header (``x-session-id``, ``session-id``, a
client's own header added to ``router.session_headers``) or, in the body, ``session_id``,
``metadata.session_id``, Anthropic's ``metadata.user_id``, OpenAI's ``user`` — the most specific
first. The session home follows it: the turns of one session go to one node even where nothing
holds their prompts yet; a malformed header is a 400 before anything is read or reserved."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.parse import request_session
from tests.edgekit import ADMIN, MODEL, bearer, completion, edge, recording_engine


@pytest.mark.parametrize(
    ("body", "session"),
    [
        ({"user": "u1"}, "u1"),
        ({"user": "u1", "session_id": "s1"}, "s1"),
        ({"user": "u1", "metadata": {"session_id": "s2"}}, "s2"),
        ({"user": "u1", "metadata": {"user_id": "anthropic-user"}}, "anthropic-user"),
        ({"metadata": {"user_id": "a", "session_id": "b"}}, "b"),
        ({"user": "", "session_id": None}, None),
        ({"metadata": "not a mapping", "user": "u"}, "u"),
        ({"session_id": {"nested": 1}, "user": "u"}, "u"),
        ({"session_id": 42}, "42"),
        ({}, None),
    ],
)
def test_the_body_names_the_session_most_specific_first(
    body: dict[str, Any], session: str | None
) -> None:
    assert request_session(body) == session


async def test_a_session_header_sets_the_session_and_its_home() -> None:
    """Ten turns of one agent session with prompts that share nothing: every turn lands on the
    same node (the session's home), and the records name the header's session, not the body's
    ``user``. Another session's turns may go elsewhere; a client header added to the
    settings counts too."""
    async with edge(engines=4, router={"session_headers": ["x-session-id", "x-agent-run"]}) as e:
        for turn in range(10):
            body = completion(prompt=f"turn {turn}: " + "tool output " * (20 + turn), user="me")
            status, out, _ = await e.call(
                "POST", "/v1/completions", body, {**bearer("sk-alpha"), "x-session-id": "agent-7"}
            )
            assert status == 200, out
        decisions = e.decisions()
        assert [d.session_id for d in decisions] == ["agent-7"] * 10
        nodes = [d.chosen_node for d in decisions]
        assert len(set(nodes)) == 1, nodes
        for turn in range(10):  # the control: the same prompts without a session spread
            body = completion(prompt=f"control {turn}: " + "plain words " * (20 + turn))
            status, out, _ = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
            assert status == 200, out
        loose = [d.chosen_node for d in e.decisions()[10:]]
        assert len(set(loose)) > 1, loose
        status, out, _ = await e.call(
            "POST",
            "/v1/completions",
            completion(prompt="other " * 30),
            {**bearer("sk-alpha"), "X-Agent-Run": "run-1"},
        )
        assert status == 200, out
        assert e.decisions()[-1].session_id == "run-1"


@pytest.mark.parametrize("value", ["has space", "x" * 257, "tab\there", "é"])
async def test_a_malformed_session_header_is_refused_before_anything_is_reserved(
    value: str,
) -> None:
    async with edge() as e:
        status, out, _ = await e.call(
            "POST", "/v1/completions", completion(), {**bearer("sk-alpha"), "session-id": value}
        )
        assert status == 400 and "session-id" in str(out), out
        assert await e.reservations() == 0


async def _turn(e: Any, session: str, prompt: str) -> str:
    status, out, headers = await e.call(
        "POST",
        "/v1/completions",
        completion(prompt=prompt, max_tokens=4),
        {**bearer("sk-alpha"), "x-session-id": session},
    )
    assert status == 200, out
    return str(headers["X-Kvgate-Node"])


async def test_a_paused_session_is_held_not_running_and_released_after_its_gap() -> None:
    """A session's turn ends: the session is paused (no reservation, nothing in flight), its
    prefix held on its home for the learned gap's bound — kvgate's hold, and the engine's
    (its agent says it takes retention hints) — and the hold ends with the bound. Its gaps are
    learned: after enough turns the bound is theirs, not the default."""
    router = {"session_hold_default_s": 0.6, "session_hold_max_s": 30.0}
    async with edge(engines=2, router=router) as e:
        for node in e.engines:
            e.overrides[node] = {"retention_hints": True}
        await asyncio.sleep(0.3)  # a heartbeat with it
        prompt = "tool output " * 80
        node = await _turn(e, "agent-1", prompt)
        _, state, _ = await e.call("GET", "/v1/kvgate/state", headers=bearer(ADMIN))
        held = state["sessions"]
        assert held["paused"] == 1 and held["held_blocks_by_node"][node] > 0
        assert await e.reservations() == 0 and state["inflight"] == 0  # paused: not running
        assert e.sims[node].core.cache.held_blocks > 0  # the engine keeps it too
        await asyncio.sleep(0.7)  # past the default bound
        _, state, _ = await e.call("GET", "/v1/kvgate/state", headers=bearer(ADMIN))
        assert state["sessions"]["paused"] == 0 and state["sessions"]["expired"] == 1
        for i in range(10):  # quick turns: the bound becomes the learned one (its floor)
            await asyncio.sleep(0.05)
            prompt += f" step {i}"
            await _turn(e, "agent-1", prompt)
        _, state, _ = await e.call("GET", "/v1/kvgate/state", headers=bearer(ADMIN))
        gaps = state["sessions"]["gaps"]["alpha/" + MODEL]
        assert gaps["gaps_seen"] == 10 and gaps["bound_s"] == 2.0
        assert state["sessions"]["resumed_while_held"] >= 9


async def test_no_hint_reaches_an_engine_that_does_not_take_one() -> None:
    """Without the agent's word the engine gets no hint (and a client's own never passes)."""
    async with recording_engine() as (url, seen):
        async with edge(engines=1) as e:
            e.engines["n1"] = url
            await asyncio.sleep(0.3)
            status, out, _ = await e.call(
                "POST",
                "/v1/completions",
                completion(agent_hint={"cache_control": {"ttl": 3600}}),
                {**bearer("sk-alpha"), "x-session-id": "s"},
            )
            assert status == 200, out
            e.overrides["n1"] = {"retention_hints": True}
            await asyncio.sleep(0.3)
            await e.call(
                "POST", "/v1/completions", completion(), {**bearer("sk-alpha"), "x-session-id": "s"}
            )
    first, second = seen.bodies
    assert "agent_hint" not in first
    assert second["agent_hint"] == {
        "session_id": "s",
        "cache_control": {"type": "ephemeral", "ttl": 60.0},
    }


async def test_a_turn_that_comes_back_while_held_is_admitted_as_resuming() -> None:
    """The hold reaches admission: a session's next turn within its hold asks as resuming
    (it queues ahead of new sessions, admission/queue.py); a first turn, or one after the hold
    ended, does not."""
    async with edge(engines=1, router={"session_hold_default_s": 0.5}) as e:
        asks: list[bool] = []
        gate = e.router.gate
        admit = gate.screen_and_admit

        async def spy(ask: Any, now: float) -> Any:
            asks.append(ask.resuming)
            return await admit(ask, now)

        gate.screen_and_admit = spy  # type: ignore[method-assign]
        await _turn(e, "agent-2", "files " * 50)
        await _turn(e, "agent-2", "files " * 60)
        await asyncio.sleep(0.6)
        await _turn(e, "agent-2", "files " * 70)
        assert asks == [False, True, False]


async def test_subagents_start_at_their_parents_home() -> None:
    """Six subagents of one agent (each its own session, prompts sharing nothing with the
    parent's), naming the parent in ``x-parent-session-id`` or ``metadata.parent_session_id``:
    their first turns go to the parent's home. The same six without a parent spread."""
    async with edge(engines=4) as e:
        home = await _turn(e, "orchestrator", "plan the refactor " * 40)
        for i in range(6):
            body = completion(prompt=f"subtask {i}: " + "grep output " * (30 + i), max_tokens=2)
            headers = {**bearer("sk-alpha"), "x-session-id": f"sub-{i}"}
            if i % 2:
                headers["x-parent-session-id"] = "orchestrator"
            else:
                body["metadata"] = {"parent_session_id": "orchestrator"}
            status, out, got = await e.call("POST", "/v1/completions", body, headers)
            assert status == 200, out
            assert got["X-Kvgate-Node"] == home, i
        alone = set()
        for i in range(6):
            body = completion(prompt=f"other task {i}: " + "ls output " * (30 + i), max_tokens=2)
            headers = {**bearer("sk-alpha"), "x-session-id": f"lone-{i}"}
            status, out, got = await e.call("POST", "/v1/completions", body, headers)
            alone.add(got["X-Kvgate-Node"])
        assert len(alone) > 1, alone


async def test_long_contexts_are_placed_by_room_and_overflow_to_one_node() -> None:
    """Long-context sessions through the live router (two engines of 6,400 tokens of KV,
    contexts of ~2,100): each new session goes where resident contexts leave it room, the
    fewest first; a longer one that has room nowhere goes to the node most committed already,
    not to the one with the most left — the reasons in the decision records. Each ended turn
    keeps its session counted on its node past the window from its routing (the end reaches
    the policy: ``/v1/kvgate/state``)."""
    router = {"cost": {"resident_window_s": 1.0}, "session_hold_default_s": 60.0}
    async with edge(engines=2, blocks=400, router=router) as e:
        prompt = "tool output " * 700  # 2,101 approximate tokens
        nodes = [await _turn(e, f"agent-{i}", f"{i} " + prompt) for i in range(5)]
        first, second = nodes[0], nodes[1]
        assert first != second and nodes[2:] == [first, second, first]  # 3 and 2 contexts
        longer = await _turn(e, "agent-long", "long " + "tool output " * 800)  # 2,402 tokens
        assert longer == first  # 6,303 + 2,402 and 4,202 + 2,402: both over 6,400
        reasons = [d.reason for d in e.decisions()]
        assert reasons == ["session_place"] * 5 + ["session_overflow"], reasons
        await asyncio.sleep(1.2)  # past the routing's window: the ends keep them counted
        _, state, _ = await e.call("GET", "/v1/kvgate/state", headers=bearer(ADMIN))
        resident = state["sessions"]["resident_tokens_by_node"]
        assert resident == {first: 3 * 2101 + 2402, second: 2 * 2101}, resident


@pytest.mark.parametrize(("wait_s", "moves"), [(0.25, True), (0.0, False)])
async def test_turns_leave_an_overflow_node_whose_queue_is_long(wait_s: float, moves: bool) -> None:
    """Through the live router, engines computing 2,000 prompt tokens a second: nine sessions
    of ~700-token contexts placed by room (five on one node, four on the other), then a
    4,000-token one that has room nowhere overflows onto the node of five. Eight turns of the
    last small session there arrive at once, each its context and ~200 new tokens: the first
    ones queue on the node holding the context, and once that queue is longer than
    ``resident_overflow_wait_s`` a turn that starts sooner computing its whole prompt on the
    other node, where it has room, goes there (``session_move``). With the bound at 0 every
    turn stays."""
    router = {
        "cost": {
            "resident_overflow_wait_s": wait_s,
            "resident_move_gain": 1.0,
            "prefill_tokens_per_s": 2_000.0,
        },
        "session_hold_default_s": 60.0,
    }
    profile = {"prefill_tokens_per_s": 2_000.0}
    async with edge(engines=2, blocks=400, router=router, profile=profile) as e:
        placed = [await _turn(e, f"agent-{i}", f"{i} " + "tool output " * 230) for i in range(9)]
        home = await _turn(e, "agent-big", "big " + "tool output " * 1330)
        assert e.decisions()[-1].reason == "session_overflow"
        assert placed.count(home) == 5 and placed[-1] == home, (placed, home)
        context = "8 " + "tool output " * 230
        more = [f"{context} result {k} " + "line " * 150 for k in range(8)]
        nodes = await asyncio.gather(*(_turn(e, "agent-8", prompt) for prompt in more))
        later = e.decisions()[10:]
        reasons = [d.reason for d in later]
        assert ("session_move" in reasons) is moves, (reasons, nodes)
        assert all(d.chosen_node != home for d in later if d.reason == "session_move"), later
        if not moves:
            assert set(nodes) == {home}, nodes
