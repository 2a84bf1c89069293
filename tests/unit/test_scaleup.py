"""When a model with no ready node is scaling up, and how long its starts take
(router/decision/scaleup.py); an autoscaler's scale message reaching the router."""

from __future__ import annotations

from router.control import ControlFollower
from router.decision.fleet import Fleet
from router.decision.scaleup import ScaleUps, ready, scaling
from router.settings import RouterSettings
from streams.kafka import KafkaBus
from streams.schemas import ControlMessage
from streams.settings import KafkaSettings
from tests.factories import NOW, node_view


def test_a_model_is_scaling_while_a_node_of_it_starts_or_something_asked_for_one() -> None:
    starting = node_view("a", healthy=False)
    assert not ready([starting], "m", NOW) and scaling([starting], "m", NOW)
    assert ready([starting, node_view("b")], "m", NOW)
    gone = node_view("a", healthy=False, heartbeat_ts=NOW - 60)  # no longer beating
    assert not scaling([gone], "m", NOW)
    assert not scaling([starting], "m", NOW, seen_ready={"a"})  # it served, then failed
    assert not ready([node_view("b", draining=True)], "m", NOW)
    assert scaling([], "m", NOW, at_zero=["m"]) and not scaling([], "m", NOW)
    assert scaling([], "m", NOW, desired={"m": 2}) and not scaling([], "m", NOW, desired={"m": 0})


def test_starts_are_learned_and_the_retry_after_counts_down() -> None:
    ups = ScaleUps(default_s=60.0, weight=0.5)
    ups.cold("m", 100.0)
    ups.cold("m", 105.0)  # (the cold period started at the first)
    assert ups.retry_after_s("m", 110.0) == 50.0
    assert ups.warm("m", 120.0) == 20.0 and ups.expected_s("m") == 20.0
    assert ups.warm("m", 130.0) is None  # not cold
    ups.cold("m", 200.0)
    ups.warm("m", 240.0)
    assert ups.expected_s("m") == 30.0  # 20 + 0.5 × (40 − 20)
    ups.cold("m", 300.0)
    assert ups.retry_after_s("m", 400.0) == 1.0  # overdue: come back soon


def test_scale_messages_reach_the_waiting_room_and_bad_ones_are_refused() -> None:
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:1", namespace="t")
    control = ControlFollower(
        kafka,
        KafkaBus(kafka, "t"),
        None,
        "t",
        Fleet(  # type: ignore[arg-type]
            RouterSettings().outlier, RouterSettings().slow_start
        ),
    )
    asked: dict[str, int] = {}
    control.on_scale = asked.__setitem__

    def msg(payload: dict[str, object]) -> ControlMessage:
        return ControlMessage(subject="scale/default/m", kind="scale", ts=NOW, payload=payload)

    assert control.handle(msg({"model": "m", "desired_replicas": 2})) == "scaled"
    assert asked == {"m": 2}
    for bad in (
        {"model": "m"},
        {"model": "", "desired_replicas": 1},
        {"model": "m", "desired_replicas": True},
    ):
        assert control.handle(msg(bad)).startswith("invalid")
    assert asked == {"m": 2}
