"""Sessions as agent clients name them: a session header (``x-session-id``, ``session-id``, a
client's own header added to ``router.session_headers``) or, in the body, ``session_id``,
``metadata.session_id``, Anthropic's ``metadata.user_id``, OpenAI's ``user`` — the most specific
first. The session home follows it: the turns of one session go to one node even where nothing
holds their prompts yet; a malformed header is a 400 before anything is read or reserved."""

from __future__ import annotations

from typing import Any

import pytest

from router.parse import request_session
from tests.edgekit import bearer, completion, edge


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
