"""The fleet rules in the simulator, with the live router's code (router/decision/fleet.py): a
drained node gets nothing new, a broken engine is ejected after a few failures and comes back once
healed, a joining node ramps up over its slow-start window, a canary takes its share."""

from __future__ import annotations

from collections import Counter

from agents.profile import EngineProfile
from analytics.sim.cluster import simulate
from analytics.sim.simconfig import FleetOp, SimConfig
from analytics.sim.traces import Trace, TraceRequest
from router.decision.policies import LeastRequestsPolicy
from router.decision.weights import OutlierSettings, SlowStartSettings

PROFILE = EngineProfile(num_gpu_blocks_override=2000, block_size=16)


def trace(n: int = 600, rate: float = 20.0) -> Trace:
    reqs = tuple(
        TraceRequest(i / rate, 160, 8, tuple(range(i * 100, i * 100 + 10)), session_id=None)
        for i in range(n)
    )
    return Trace("fleet", 16, reqs)


def test_a_drained_node_gets_nothing_new_and_returns_when_undrained() -> None:
    ops = (FleetOp(5.0, "drain", "node-01"), FleetOp(15.0, "undrain", "node-01"))
    done = simulate(trace(), LeastRequestsPolicy(), SimConfig(nodes=3, profile=PROFILE, ops=ops))
    on = [d.request.arrival_s for d in done if d.node == "node-01"]
    # a heartbeat later at most, as on a live router (the drain is read from the control topic)
    assert not [t for t in on if 5.0 + 0.5 < t < 15.0]
    assert any(t < 5.0 for t in on) and any(t > 15.5 for t in on)
    assert len(done) == 600


def test_a_broken_engine_is_ejected_and_a_healed_one_returns() -> None:
    base = SimConfig(nodes=4, profile=PROFILE, faults=(("node-02", 1.0),))
    stats: dict[str, int] = {}
    simulate(trace(), LeastRequestsPolicy(), base, stats)
    without = stats["failed"]
    assert without > 100  # the fleet keeps feeding it (it answers fastest)
    outlier = OutlierSettings(consecutive_errors=5, base_ejection_time_s=5)
    ops = (FleetOp(8.0, "heal", "node-02"),)
    cfg = SimConfig(nodes=4, profile=PROFILE, faults=(("node-02", 1.0),), outlier=outlier, ops=ops)
    stats = {}
    done = simulate(trace(), LeastRequestsPolicy(), cfg, stats)
    # five failures, then one failed probe per ejection until it heals
    assert stats["failed"] <= 5 + 4 and stats["ejections"] >= 2
    assert len(done) + stats["failed"] == 600
    assert any(d.node == "node-02" and d.request.arrival_s > 16.0 for d in done)


def test_a_joining_node_ramps_up_over_its_slow_start_window() -> None:
    ops = (FleetOp(2.0, "join", "late"),)
    counts = []
    for window in (0.0, 10.0):
        cfg = SimConfig(
            nodes=3, profile=PROFILE, ops=ops, slow_start=SlowStartSettings(window_s=window)
        )
        done = simulate(trace(n=800), LeastRequestsPolicy(), cfg)
        # the first 2.5 s of the node's life: a quarter of its 10 s ramp
        first = [d for d in done if 2.5 < d.request.arrival_s < 4.5]
        counts.append(Counter(d.node for d in first)["late"] / len(first))
    full, slowed = counts
    assert full > 0.2  # without slow start it takes its share at once
    assert slowed < 0.6 * full


def test_a_canary_takes_its_share() -> None:
    ops = (FleetOp(0.0, "canary", nodes=("node-03",), share=0.1),)
    done = simulate(
        trace(n=2000, rate=40), LeastRequestsPolicy(), SimConfig(nodes=4, profile=PROFILE, ops=ops)
    )
    share = Counter(d.node for d in done)["node-03"] / len(done)
    assert 0.07 < share < 0.13
