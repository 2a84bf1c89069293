"""The fleet rules in front of every routing decision (router/decision/fleet.py,
router/decision/outlier.py):
outlier ejection with Envoy's semantics, slow start of new replicas, canary shares. Time is
passed in."""

from __future__ import annotations

import pytest

from router.decision.fleet import Fleet
from router.decision.outlier import OutlierDetector
from router.decision.types import NodeView
from router.decision.weights import OutlierSettings, SlowStartSettings
from tests.factories import node_view


def view(node: str, started_at: float | None = None) -> NodeView:
    return node_view(node, started_at=started_at)


def test_consecutive_errors_eject_and_ejection_time_grows_with_half_open_probing() -> None:
    d = OutlierDetector(OutlierSettings(consecutive_errors=3, base_ejection_time_s=10))
    t = 0.0
    assert d.observe("n1", "5xx", t, hosts=10) is None
    assert d.observe("n1", None, t, hosts=10) is None  # a success resets the count
    for _ in range(2):
        assert d.observe("n1", "timeout", t, hosts=10) is None
    assert d.observe("n1", "connect", t, hosts=10) == "consecutive_connect"
    assert d.ejected(t + 9.9) == {"n1"}
    # time up: probing, one request at a time
    assert d.ejected(t + 10.0) == set()
    d.sent("n1", t + 10.0)
    assert d.ejected(t + 10.1) == {"n1"}  # its probe is in flight
    assert d.observe("n1", "5xx", t + 10.2, hosts=10) == "probe_5xx"
    # the second ejection lasts twice as long
    assert d.ejected(t + 10.2 + 19.9) == {"n1"}
    assert d.ejected(t + 10.2 + 20.0) == set()
    d.sent("n1", t + 30.2)
    assert d.observe("n1", None, t + 30.3, hosts=10) is None
    assert d.state(t + 30.3)["n1"]["status"] == "suspect"  # back, multiplier not forgiven yet
    assert d.ejected(t + 30.3) == set()
    assert d.nodes["n1"].ejections == 2


def test_four_xx_and_cancellations_are_not_failures_and_a_lost_probe_fails() -> None:
    d = OutlierDetector(OutlierSettings(consecutive_errors=2, probe_timeout_s=5))
    for _ in range(10):
        d.observe("n1", None, 0.0, hosts=5)  # what a 4xx is to the detector
    assert d.ejected(0.0) == set()
    d.observe("n1", "5xx", 1.0, hosts=5)
    d.observe("n1", "5xx", 1.0, hosts=5)
    assert d.ejected(1.0) == {"n1"}
    assert d.ejected(31.0) == set()
    d.sent("n1", 31.0)
    assert d.ejected(35.9) == {"n1"}
    assert d.ejected(36.1) == {"n1"}  # no outcome within probe_timeout_s: ejected again
    assert d.nodes["n1"].ejections == 2


def test_max_ejection_percent_keeps_the_fleet_but_always_allows_one() -> None:
    d = OutlierDetector(OutlierSettings(consecutive_errors=1, max_ejection_percent=10))
    assert d.observe("a", "5xx", 0.0, hosts=3) == "consecutive_5xx"  # at least one
    assert d.observe("b", "5xx", 0.0, hosts=3) is None  # a second would exceed 10 %
    assert d.ejected(0.0) == {"a"}
    d2 = OutlierDetector(OutlierSettings(consecutive_errors=1, max_ejection_percent=50))
    for n in "abcd":
        d2.observe(n, "5xx", 0.0, hosts=4)
    assert len(d2.ejected(0.0)) == 2


def test_success_rate_outlier_is_ejected_after_the_interval() -> None:
    s = OutlierSettings(
        consecutive_errors=1000,
        interval_s=10,
        success_rate_minimum_hosts=5,
        success_rate_request_volume=20,
        max_ejection_percent=50,
    )
    d = OutlierDetector(s)
    d.tick(0.0)
    for i in range(100):
        for n in ("a", "b", "c", "d", "e"):
            d.observe(n, None, 1.0, hosts=6)
        d.observe("bad", "5xx" if i % 2 else None, 1.0, hosts=6)  # 50 % success
    assert d.ejected(9.0) == set()
    assert d.tick(10.0) == ["bad"]
    assert d.ejected(10.0) == {"bad"} and d.nodes["bad"].last_cause == "success_rate"
    # too few hosts with enough volume: no analysis
    d2 = OutlierDetector(s)
    d2.tick(0.0)
    for _ in range(30):
        d2.observe("x", None, 1.0, hosts=2)
        d2.observe("y", "5xx" if _ % 3 else None, 1.0, hosts=2)
    assert d2.tick(10.0) == []


def test_multiplier_is_forgiven_one_interval_at_a_time() -> None:
    d = OutlierDetector(OutlierSettings(consecutive_errors=1, base_ejection_time_s=1))
    d.tick(0.0)
    d.observe("n", "5xx", 0.0, hosts=5)
    assert d.nodes["n"].multiplier == 1
    d.ejected(2.0)
    d.sent("n", 2.0)
    d.observe("n", None, 2.0, hosts=5)
    d.tick(10.0)
    assert d.nodes["n"].multiplier == 0
    d.forget([])  # gone, nothing pending: forgotten
    assert "n" not in d.nodes


def test_ejected_nodes_are_left_out_and_marked_in_the_reason() -> None:
    f = Fleet(OutlierSettings(consecutive_errors=1), SlowStartSettings(window_s=0))
    nodes = [view("a"), view("b"), view("c")]
    f.detector.observe("a", "5xx", 0.0, hosts=3)
    sel = f.select(nodes, "r1", 1.0)
    assert [n.node_id for n in sel.nodes] == ["b", "c"] and sel.ejected == ("a",)
    assert f.reason("prefix_hit", "b", sel, {"a": 5, "b": 1}) == "ejected/prefix_hit"
    assert f.reason("least_cost", "b", sel, {"b": 1}) == "least_cost"
    # never empties the list: the only node stays even when ejected
    only = f.select([view("a")], "r2", 1.0)
    assert [n.node_id for n in only.nodes] == ["a"] and only.ejected == ()


@pytest.mark.parametrize(("age", "share"), [(0.0, 0.1), (30.0, 0.5), (54.0, 0.9), (60.0, 1.0)])
def test_slow_start_offers_a_new_replica_a_growing_share(age: float, share: float) -> None:
    f = Fleet(OutlierSettings(), SlowStartSettings(window_s=60, min_weight=0.1))
    now = 1000.0
    nodes = [view("old", started_at=0.0), view("new", started_at=now - age)]
    offered = sum(
        "new" in {n.node_id for n in f.select(nodes, f"r{i}", now).nodes} for i in range(4000)
    )
    assert offered / 4000 == pytest.approx(share, abs=0.03)


def test_slow_start_spares_a_fleet_that_starts_together() -> None:
    f = Fleet(OutlierSettings(), SlowStartSettings(window_s=60))
    nodes = [view("a", started_at=100.0), view("b", started_at=101.0)]
    for i in range(50):
        assert len(f.select(nodes, f"r{i}", 110.0).nodes) == 2
    assert f.counts(nodes, 110.0)["slow_start"] == 0
    assert f.counts([*nodes, view("c", started_at=0.0)], 110.0)["slow_start"] == 2


def test_first_sighting_stands_in_for_the_engine_start_time() -> None:
    f = Fleet(OutlierSettings(), SlowStartSettings())
    assert f.started("n", "e1", None, 5.0) == 5.0
    assert f.started("n", "e1", None, 9.0) == 5.0
    assert f.started("n", "e2", None, 9.0) == 9.0  # a new agent incarnation
    assert f.started("n", "e2", 3.0, 9.0) == 3.0  # the engine's own start wins


def test_a_canary_group_takes_its_share_and_only_its_share() -> None:
    f = Fleet(OutlierSettings(), SlowStartSettings(window_s=0))
    nodes = [view(n) for n in ("a", "b", "c", "canary")]
    f.set_canary("v2", ["canary"], 0.05)
    hits = 0
    for i in range(20_000):
        sel = f.select(nodes, f"r{i}", 0.0)
        ids = {n.node_id for n in sel.nodes}
        if sel.canary == "v2":
            assert ids == {"canary"}
            hits += 1
        else:
            assert "canary" not in ids
    assert hits / 20_000 == pytest.approx(0.05, abs=0.005)
    # the same key always lands the same way (sessions stay on one side)
    assert f.select(nodes, "s1", 0.0).canary == f.select(nodes, "s1", 5.0).canary
    # a canary group with no eligible node: its share goes to the others
    sel = f.select(nodes[:3], "r0", 0.0)
    assert {n.node_id for n in sel.nodes} == {"a", "b", "c"}
    f.set_canary("v2", ["canary"], 0.0)
    assert not f.canaries
