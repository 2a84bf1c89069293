"""Drain and canary messages on kvgate.control: one subject per node or group (the compacted
topic keeps its latest state), applied in order, malformed ones refused."""

from __future__ import annotations

from collections import Counter

from pydantic import SecretStr

from router.control import ControlFollower, canary_message, drain_message
from router.decision.fleet import Fleet
from router.decision.weights import OutlierSettings, SlowStartSettings
from streams.controlauth import ControlAuth
from streams.schemas import ControlMessage


def _follower(auth: ControlAuth | None = None) -> ControlFollower:
    f = ControlFollower.__new__(ControlFollower)
    f.fleet = Fleet(OutlierSettings(), SlowStartSettings())
    f.refused, f.applied = 0, 0
    f.auth, f.refusals = auth or ControlAuth({}), Counter()
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


KEYS = {"k1": SecretStr("first secret"), "k2": SecretStr("second secret")}


def test_with_control_keys_only_signed_and_newer_messages_apply() -> None:
    """Anyone who can write to the topic could drain every node: with keys set a router applies
    only messages signed with one of them, each newer than the last of its subject (a captured
    message published again changes nothing), and says why it refused the others."""
    operator = ControlAuth(KEYS, "k1")
    f = _follower(ControlAuth(KEYS))
    assert f.handle(drain_message("n1", True)) == "refused: unsigned"
    assert "n1" not in f.fleet.drained
    drained = operator.sign(drain_message("n1", True, now=100.0))
    assert f.handle(drained) == "drained" and "n1" in f.fleet.drained
    back = operator.sign(drain_message("n1", False, now=101.0))
    assert f.handle(back) == "undrained" and "n1" not in f.fleet.drained
    assert f.handle(drained) == "refused: stale"  # the old drain, replayed
    assert "n1" not in f.fleet.drained
    tampered = drained.model_copy(update={"ts": 102.0, "payload": {"node": "n1"}})
    assert f.handle(tampered.model_copy(update={"subject": "drain/n2"})) == "refused: bad_signature"
    rotated = ControlAuth(KEYS, "k2").sign(drain_message("n2", True, now=103.0))
    assert f.handle(rotated) == "drained"  # another key of the set: a rotation
    stranger = ControlAuth({"k3": SecretStr("x")}).sign(drain_message("n3", True, now=104.0))
    assert f.handle(stranger) == "refused: unknown_key"
    assert dict(f.refusals) == {"unsigned": 1, "stale": 1, "bad_signature": 1, "unknown_key": 1}


def test_without_keys_nothing_is_signed_or_checked() -> None:
    plain = ControlAuth({})
    msg = drain_message("n1", True, now=5.0)
    assert plain.sign(msg) == msg and plain.check(msg) is None and plain.check(msg) is None
    signed = ControlAuth(KEYS).sign(msg)
    assert signed.key_id == "k1" and signed.signature is not None  # the first id by default


def test_every_control_message_a_process_publishes_is_signed() -> None:
    """The bus signs what goes to kvgate.control (CLI, routers' pre-warm advice, the
    autoscaler), whoever built the message."""
    from streams.codec import decode
    from streams.kafka import KafkaBus
    from streams.settings import KafkaSettings
    from streams.topics import CONTROL

    bus = KafkaBus(KafkaSettings(control_keys=KEYS, control_key_id="k2"), "t")
    assert bus.post(CONTROL, "drain/n1", drain_message("n1", True, now=7.0))
    (_, _, raw), *_ = bus._outbox
    sent = decode(ControlMessage, raw or b"")
    assert sent.key_id == "k2" and ControlAuth(KEYS).check(sent) is None
