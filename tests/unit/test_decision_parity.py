"""The simulator is the router: over one trace, every routing decision the simulator takes is
the one the live router's rules (built by the router's own service from its settings) take
from the same views — the same node for the same reason, held or refused alike."""

from __future__ import annotations

import pytest

from admission.settings import AdmissionSettings
from analytics.sim import cluster
from analytics.sim.cluster import simulate
from analytics.sim.replay import at_load, capacity_rps, open_trace
from analytics.sim.simconfig import SimConfig
from router.decision.pipeline import Ask, Decision, Held, Routed, Rules, Snapshot, commit, decide
from router.decision.policies import make_policy
from router.decision.weights import OutlierSettings, SlowStartSettings
from router.runtime import build_router
from router.settings import RouterSettings
from streams.kafka import KafkaBus
from streams.replica import TableReplica
from streams.settings import KafkaSettings, WorkerSettings


def _outcome(d: Decision) -> tuple[str, str | None, str]:
    if isinstance(d, Held):
        return ("held", d.blocker, d.why)
    return (type(d).__name__, d.decision.chosen, d.decision.reason)


@pytest.mark.parametrize("load", [0.8, 1.3])
def test_the_simulator_decides_as_the_live_router_does(
    monkeypatch: pytest.MonkeyPatch, load: float
) -> None:
    settings = RouterSettings(
        policy="kvgate",
        outlier=OutlierSettings(enabled=False),
        slow_start=SlowStartSettings(window_s=0),
    )
    trace = open_trace("conversation", limit=600)
    cfg = SimConfig(nodes=4, lanes=settings.lanes, max_queue=settings.max_queue)
    trace = at_load(trace, load, capacity_rps(trace, cfg))
    seen: list[tuple[Ask, Snapshot, Decision]] = []

    def recorded(ask: Ask, snap: Snapshot, rules: Rules) -> Decision:
        got = decide(ask, snap, rules)
        seen.append((ask, snap, got))
        return got

    monkeypatch.setattr(cluster, "decide", recorded)
    done = simulate(trace, make_policy(settings), cfg)
    assert len(done) > 400 and len(seen) >= len(done)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:1", namespace="parity")
    live = build_router(
        settings,
        TableReplica(kafka, WorkerSettings(), "parity"),
        KafkaBus(kafka, "parity"),
        make_policy(settings),
        AdmissionSettings(),
    )
    outcomes: set[str] = set()
    for ask, snap, got in seen:
        theirs = decide(ask, snap, live.director.rules)
        assert _outcome(theirs) == _outcome(got), ask.request.request_id
        outcomes.add(_outcome(got)[0])
        if isinstance(theirs, Routed):  # sent: the live router commits it as the simulator did
            commit(ask, snap, theirs, live.director.rules, live.ledger)
    assert outcomes >= {"Routed", "held"}  # the lane rules held some on the way
