"""The alert rules name only metrics the router exports."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from router.metrics import RouterMetrics

RULES = Path(__file__).resolve().parents[2] / "deploy/helm/kvgate/files/kvgate-rules.yaml"


def test_every_rule_names_exported_metrics() -> None:
    m = RouterMetrics()
    m.nodes_kv_index.labels("degraded").set(1)
    m.kv_agent.labels("kv_events_undecodable").set(1)
    m.degraded.labels("last_known").set(1)
    m.kafka_dropped.labels("t").set(1)
    m.rejected("nodes_unhealthy")
    m.decided("cache_hit", 10.0)
    m.inflight.labels("normal").set(1)
    m.token_checks.labels("m").inc()
    m.token_mismatches.labels("m").inc()
    exported = set(re.findall(r"^(kvgate_[a-z_]+)", m.render().decode(), re.MULTILINE))
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert len(rules) >= 9
    for rule in rules:
        assert rule["alert"].startswith("Kvgate") and rule["annotations"]["summary"]
        names = set(re.findall(r"kvgate_[a-z_]+", rule["expr"]))
        assert names and names <= exported, (rule["alert"], names - exported)
