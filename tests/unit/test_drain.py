"""Drain and canary messages on kvgate.control: one subject per node or group (the compacted
topic keeps its latest state), applied in order, malformed ones refused."""

from __future__ import annotations

from router.control import ControlFollower, canary_message, drain_message
from router.decision.fleet import Fleet
from router.decision.weights import OutlierSettings, SlowStartSettings
from streams.schemas import ControlMessage


def _follower() -> ControlFollower:
    f = ControlFollower.__new__(ControlFollower)
    f.fleet = Fleet(OutlierSettings(), SlowStartSettings())
    f.refused, f.applied = 0, 0
    return f


def test_drain_messages_apply_in_order_and_bad_ones_are_refused() -> None:
    f = _follower()
    assert drain_message("n1", True).subject == drain_message("n1", False).subject == "drain/n1"
    assert f.handle(drain_message("n1", True)) == "drained"
    assert f.handle(drain_message("n2", True)) == "drained"
    assert f.handle(drain_message("n1", False)) == "undrained"
    assert f.fleet.drained == {"n2"}
    forged = ControlMessage(subject="drain/n3", kind="drain", ts=1.0, payload={"node": "n4"})
    assert f.handle(forged).startswith("invalid") and f.refused == 1
    assert f.fleet.drained == {"n2"}


def test_canary_messages_set_and_end_groups_and_bad_ones_are_refused() -> None:
    f = _follower()
    assert f.handle(canary_message("v2", ["n1", "n2"], 0.05)) == "applied"
    g = f.fleet.canaries["v2"]
    assert g.nodes == {"n1", "n2"} and g.share == 0.05
    assert f.handle(canary_message("v2", ["n1"], 0.0)) == "ended"
    assert "v2" not in f.fleet.canaries
    bad = [
        ControlMessage(subject="canary/x", kind="canary", ts=1.0, payload={"group": "y"}),
        canary_message("v3", ["n1"], 1.5),
        ControlMessage(
            subject="canary/v4",
            kind="canary",
            ts=1.0,
            payload={"group": "v4", "nodes": "n1", "share": 0.1},
        ),
        ControlMessage(
            subject="canary/v5",
            kind="canary",
            ts=1.0,
            payload={"group": "v5", "nodes": ["n1"], "share": True},
        ),
    ]
    for msg in bad:
        assert f.handle(msg).startswith("invalid"), msg
    assert f.refused == len(bad) and not f.fleet.canaries
