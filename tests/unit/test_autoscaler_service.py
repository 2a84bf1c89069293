"""kvgate autoscale's bookkeeping (analytics/autoscaler.py), without Kafka."""

from __future__ import annotations

import time

from prometheus_client import generate_latest

from analytics.autoscale import AutoscaleSettings
from analytics.autoscaler import MAX_KEYS, AutoscaleService, PoolState, observations
from streams.settings import KafkaSettings
from tests.factories import decision, heartbeat


def test_observations_count_live_serving_replicas_and_traffic() -> None:
    now = time.time()
    st = PoolState()
    st.heartbeat(heartbeat("a", seq=1, ts=now, waiting=3, running=5, kv_blocks_used=50))
    st.heartbeat(heartbeat("a", seq=0, ts=now, waiting=99))  # older seq: ignored
    st.heartbeat(heartbeat("b", ts=now, running=1, kv_blocks_used=10))
    st.heartbeat(heartbeat("c", ts=now, draining=True))  # not serving
    st.heartbeat(heartbeat("d", ts=now - 60))  # lease long gone
    st.heartbeat(heartbeat("e", ts=now, model="other"))
    for i in range(7):
        st.decision(decision(f"r{i}", admission="rejected" if i < 2 else "admitted"))
    obs = observations(st, now)
    m = obs[("default", "m")]
    assert (m.replicas, m.waiting, m.running, m.arrivals, m.refusals) == (2, 3, 6, 7, 2)
    assert abs(m.kv_used - 0.3) < 1e-9
    assert obs[("default", "other")].replicas == 1 and obs[("default", "other")].arrivals == 0


def test_tick_exports_publishes_and_resets() -> None:
    s = AutoscaleSettings(replica_rps=1.0, interval_s=10, target_utilization=1.0)
    svc = AutoscaleService(KafkaSettings(), s, bus=None)  # type: ignore[arg-type]
    now = time.time()
    svc.ingest([heartbeat("a", ts=now), *(decision(f"r{i}") for i in range(50))])
    msgs = svc.tick(now)
    assert len(msgs) == 1 and msgs[0].kind == "scale" and msgs[0].subject == "scale/default/m"
    assert msgs[0].payload["desired_replicas"] == 5  # 5 req/s at 1 req/s per replica
    text = generate_latest(svc.registry).decode()
    assert 'kvgate_autoscale_desired_replicas{model="m",pool="default"} 5.0' in text
    assert svc.state.arrivals == {} and svc.tick(now + 10)[0].payload["arrivals_rps"] == 0


def test_bounds_hold() -> None:
    st = PoolState()
    for i in range(MAX_KEYS + 5):
        st.decision(decision(f"r{i}", model=f"m{i}"))
    assert len(st.arrivals) == MAX_KEYS and st.dropped == 5
