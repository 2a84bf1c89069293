"""Which nodes a request may go to (router/decision/candidates.py): the queue-limit filter, the
backed-up refusal, and a fleet of which most is away degrading to what is left — its requests
admitted against the budget of the nodes still up, shed by priority with a Retry-After —
instead of every request refused while less than ``admission.min_healthy_share`` of the
capacity is healthy."""

from __future__ import annotations

from admission.core import Budget, RejectReason, admit
from admission.settings import AdmissionSettings
from router.decision.candidates import budget, candidates, healthy_share, open_candidates
from router.decision.placement import Placement
from router.decision.types import NodeView
from tests.factories import NOW, node_view

KV = 100  # blocks per node (node_view's)


def _open(nodes: list[NodeView]) -> list[str] | RejectReason:
    got = open_candidates(nodes, "m", NOW, max_queue=64, min_open_share=0.5, retry_after_s=1.0)
    return got.reason if not isinstance(got, list) else [n.node_id for n in got]


def test_nodes_over_the_queue_limit_are_left_out_and_a_backed_up_fleet_is_refused() -> None:
    nodes = [node_view("a", waiting=3), node_view("b", waiting=65), node_view("c", waiting=64)]
    assert _open(nodes) == ["a", "c"]
    # most of the healthy capacity past the cap: a bounded queue, 503 with a Retry-After
    backed_up = [node_view("a", waiting=70), node_view("b", waiting=80), node_view("c")]
    assert _open(backed_up) == RejectReason.NODES_UNHEALTHY
    got = open_candidates(backed_up, "m", NOW, 64, 0.5, 2.0)
    assert not isinstance(got, list) and got.retriable and got.retry_after_s == 2.0
    # other models' nodes, draining and unhealthy nodes are never candidates
    mixed = [
        node_view("a"),
        node_view("x", model="other"),
        node_view("d", draining=True),
        node_view("u", healthy=False),
    ]
    assert _open(mixed) == ["a"]


def test_three_of_five_nodes_down_leave_two_candidates_and_a_budget_of_two() -> None:
    fleet = [node_view(f"n{i}", healthy=i < 2) for i in range(5)]
    got = candidates(fleet, "m", NOW, max_queue=64, min_open_share=0.5, retry_after_s=1.0)
    assert isinstance(got, list) and [n.node_id for n in got] == ["n0", "n1"]
    assert healthy_share(fleet, "m", NOW) == 0.4  # under the default min_healthy_share (0.5)
    _, per_node = budget(fleet, got, "m", NOW, {})
    assert per_node == [KV, KV]  # admission counts what the two can carry, not the five


def _budget(reserved: int, nodes: int) -> Budget:
    return Budget(
        kv_blocks_total=nodes * KV,
        slots_total=nodes * 256,
        kv_blocks_reserved=reserved,
        slots_reserved=0,
        largest_node_blocks=KV,
        drain_blocks_per_s=20.0,
    )


def test_a_degraded_fleet_sheds_by_priority_with_a_retry_after_instead_of_refusing_all() -> None:
    s = AdmissionSettings()
    # the two nodes left, lightly used: every priority is served (the old rule refused all)
    for priority in ("low", "normal", "high"):
        assert admit(160, 16, 16, priority, _budget(40, 2), s).admitted
    # past red on what is left: normal refused with a computed Retry-After, high still served
    full = _budget(185, 2)
    refused = admit(160, 16, 16, "normal", full, s)
    assert not refused.admitted and refused.rejection is not None
    assert refused.rejection.reason == RejectReason.RED_WATERMARK
    assert refused.rejection.retry_after_s is not None and refused.rejection.retry_after_s >= 1
    assert admit(160, 16, 16, "high", full, s).admitted
    # the same reservations on the whole fleet would have looked idle: the budget is what shed
    assert admit(160, 16, 16, "low", _budget(185, 5), s).admitted


def test_a_placement_that_no_candidate_satisfies_is_still_refused() -> None:
    fleet = [node_view("a", labels=frozenset({("zone", "x")}))]
    got = candidates(fleet, "m", NOW, 64, 0.5, 2.0, Placement(require=frozenset({("zone", "y")})))
    assert not isinstance(got, list) and got.reason == RejectReason.NO_CAPACITY
