"""Drain messages on kvgate.control: one subject per node (the compacted topic keeps its latest
state), applied in order, malformed ones refused."""

from __future__ import annotations

from router.control import ControlFollower, drain_message
from streams.schemas import ControlMessage


def test_drain_messages_apply_in_order_and_bad_ones_are_refused() -> None:
    f = ControlFollower.__new__(ControlFollower)
    f.drained, f.refused, f.applied = set(), 0, 0
    assert drain_message("n1", True).subject == drain_message("n1", False).subject == "drain/n1"
    assert f.handle(drain_message("n1", True)) == "drained"
    assert f.handle(drain_message("n2", True)) == "drained"
    assert f.handle(drain_message("n1", False)) == "undrained"
    assert f.drained == {"n2"}
    forged = ControlMessage(subject="drain/n3", kind="drain", ts=1.0, payload={"node": "n4"})
    assert f.handle(forged).startswith("invalid") and f.refused == 1
    assert f.drained == {"n2"}
