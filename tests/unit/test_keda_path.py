"""The KEDA path short of a cluster: the ScaledObject's Prometheus query, as the chart renders
it, evaluated on what ``kvgate autoscale`` exports, and the replica count KEDA's
``AverageValue`` target makes of it — the count the autoscaler decided, for its pool and model
only."""

from __future__ import annotations

import math
import re
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from analytics.autoscale import AutoscaleSettings
from analytics.autoscaler import AutoscaleService
from streams.settings import KafkaSettings
from tests.factories import decision, heartbeat
from tests.unit.test_helm import one, render


def _evaluate(query: str, exposition: str) -> float:
    """``max(metric{label="value",...})`` over a Prometheus text exposition."""
    m = re.fullmatch(r"max\((\w+)\{(.*)\}\)", query)
    assert m is not None, query
    name, matchers = m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
    values = [
        s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in matchers.items())
    ]
    assert values, f"{query} selects nothing"
    return max(values)


def test_keda_scales_the_engines_to_what_kvgate_autoscale_decided() -> None:
    objects = render(
        "--set",
        "autoscale.enabled=true",
        "--set",
        "keda.enabled=true",
        "--set",
        "keda.pool=default",
        "--set",
        "keda.model=m",
    )
    so = one(objects, "ScaledObject", "kv-kvgate-engines")
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    # the autoscaler, fed a pool's heartbeats and decisions: 5 req/s of model m at 1 req/s a
    # replica; another model beside it at 20 req/s, which the query must not pick up
    s = AutoscaleSettings(replica_rps=1.0, interval_s=10, target_utilization=1.0)
    svc = AutoscaleService(KafkaSettings(), s, bus=None)  # type: ignore[arg-type]
    now = time.time()
    svc.ingest(
        [
            heartbeat("a", ts=now),
            heartbeat("b", ts=now, model="other"),
            *(decision(f"r{i}") for i in range(50)),
            *(decision(f"o{i}", model="other") for i in range(200)),
        ]
    )
    (mine,) = [m for m in svc.tick(now) if m.subject == "scale/default/m"]
    value = _evaluate(trigger["metadata"]["query"], generate_latest(svc.registry).decode())
    # AverageValue: the replicas that bring the metric per replica down to the threshold
    replicas = math.ceil(value / float(trigger["metadata"]["threshold"]))
    replicas = min(max(replicas, so["spec"]["minReplicaCount"]), so["spec"]["maxReplicaCount"])
    assert replicas == mine.payload["desired_replicas"] == 5
