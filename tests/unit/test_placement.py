"""Placement constraints (router/decision/placement.py): required labels filter, preferred labels
and the router's zone draw requests while those nodes have room, and malformed labels are
refused."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from pydantic import ValidationError

from admission.settings import Tenant
from agents.profile import EngineProfile
from analytics.sim.cluster import simulate
from analytics.sim.simconfig import SimConfig
from analytics.sim.traces import Trace, TraceRequest
from router.decision.placement import Placement, parse_labels, placement_of
from router.decision.policies import LeastRequestsPolicy
from router.decision.types import NodeView
from streams.schemas import Heartbeat
from tests.factories import heartbeat
from tests.unit.test_fleet import view


def labelled(node: str, kv_used: int = 0, **labels: str) -> NodeView:
    return replace(view(node), labels=frozenset(labels.items()), kv_blocks_used=kv_used)


@pytest.mark.parametrize(
    "text",
    [
        "zone",
        "zone=a,",
        "=a",
        "zone=a b",
        "zone=" + "x" * 64,
        ",".join(f"k{i}=v" for i in range(9)),
    ],
)
def test_malformed_labels_are_refused(text: str) -> None:
    if text == "zone=a,":
        assert parse_labels(text) == {("zone", "a")}  # a trailing comma is harmless
        return
    with pytest.raises(ValueError):
        parse_labels(text)


def test_tenant_labels_hold_and_a_request_can_only_add() -> None:
    p = placement_of(
        {"X-Kvgate-Require-Labels": "gpu=h100", "X-Kvgate-Prefer-Labels": "zone=b"},
        {"tier": "gold"},
        {},
        ("zone", "a"),
        0.85,
        4,
    )
    assert p.require == {("tier", "gold"), ("gpu", "h100")}
    assert p.prefer == {("zone", "b")}  # an explicit preference beats the router's zone
    assert placement_of({}, {}, {}, ("zone", "a"), 0.85, 4).prefer == {("zone", "a")}
    assert placement_of({}, {}, {}, None, 0.85, 4).free


def test_required_labels_filter_and_preferred_ones_spill_when_full() -> None:
    a1 = labelled("a1", zone="a", gpu="h100")
    a2 = labelled("a2", zone="a", gpu="l40s")
    b1 = labelled("b1", zone="b", gpu="h100")
    p = Placement(require=frozenset({("gpu", "h100")}), prefer=frozenset({("zone", "a")}))
    assert [n.node_id for n in p.allowed([a1, a2, b1])] == ["a1", "b1"]
    assert [n.node_id for n in p.preferred(p.allowed([a1, a2, b1]))] == ["a1"]
    full = labelled("a1", kv_used=90, zone="a", gpu="h100")
    assert {n.node_id for n in p.preferred(p.allowed([full, b1]))} == {"a1", "b1"}


def test_labels_are_checked_where_they_enter() -> None:
    assert heartbeat("n", labels={"zone": "eu-1a"}).labels == {"zone": "eu-1a"}
    with pytest.raises(ValidationError):
        heartbeat("n", labels={"zone": "eu 1a"})
    with pytest.raises(ValidationError):
        Heartbeat.model_validate(
            {**heartbeat("n").model_dump(), "labels": {f"k{i}": "v" for i in range(40)}}
        )
    with pytest.raises(ValidationError):
        Tenant(name="t", require_labels={"gpu": "h100;drop"})


def test_the_simulator_prefers_the_zone_and_spills_when_it_is_full() -> None:
    reqs = tuple(
        TraceRequest(i * 0.05, 160, 8, tuple(range(i * 10, i * 10 + 10))) for i in range(400)
    )
    trace = Trace("zones", 16, reqs)
    zones = tuple((f"node-{i:02d}", (("zone", "a" if i < 2 else "b"),)) for i in range(4))
    profile = EngineProfile(num_gpu_blocks_override=2000, block_size=16)
    cfg = SimConfig(
        nodes=4,
        profile=profile,
        node_labels=zones,
        placement=Placement(prefer=frozenset({("zone", "a")})),
    )
    served = Counter(d.node for d in simulate(trace, LeastRequestsPolicy(), cfg))
    assert set(served) == {"node-00", "node-01"}
    small = replace(cfg, profile=EngineProfile(num_gpu_blocks_override=60, block_size=16))
    slow = Trace("zones", 16, tuple(replace(r, arrival_s=r.arrival_s / 20) for r in reqs))
    served = Counter(d.node for d in simulate(slow, LeastRequestsPolicy(), small))
    assert served["node-02"] + served["node-03"] > 0  # zone a full: the rest take the spill
