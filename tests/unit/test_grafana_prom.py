"""The Prometheus dashboard: Grafana's own dashboard model carries every field of it, and every
query names metrics the router exports."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from deploy.grafana_prom import PROM_DASHBOARD, UID, build_prometheus
from router.metrics import RouterMetrics

REPO = Path(__file__).resolve().parents[2]


def _roundtrip(d: dict[str, Any]) -> Any:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    return json.loads(json.dumps(Dashboard.from_json(d), cls=JSONEncoder))


def _missing(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return not isinstance(b, dict) or any(k not in b or _missing(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return not isinstance(b, list) or len(a) != len(b) or any(map(_missing, a, b))
    return a != b


def test_the_committed_dashboard_is_what_the_code_builds() -> None:
    model = build_prometheus()
    for where in ("deploy/grafana/dashboards", "deploy/helm/kvgate/files/dashboards"):
        assert json.loads((REPO / where / f"{UID}.json").read_text()) == model, where
    assert not _missing(model, _roundtrip(model))  # Grafana's model keeps every field
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids)) == len(PROM_DASHBOARD)
    for p in model["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        assert all(t["datasource"]["type"] == "prometheus" for t in p["targets"])


def test_every_query_names_exported_metrics() -> None:
    m = RouterMetrics()
    m.rejected("x")
    m.decided("x", 1.0)
    m.outcome("ok")
    for h in (m.ttft, m.tpot):
        h.labels("m").observe(0.1)
    m.queue_wait.labels("normal").observe(0.1)
    for g in (m.queue_depth, m.inflight):
        g.labels("normal").set(0)
    m.budget_used.labels("default").set(0)
    m.tokens.labels("m", "prompt").inc()
    m.nodes.labels("healthy").set(1)
    m.nodes_kv_index.labels("events").set(1)
    m.degraded.labels("last_known").set(0)
    m.token_mismatches.labels("m").inc()
    m.fleet_nodes.labels("ejected").set(0)
    m.ejections.labels("consecutive_5xx").inc()
    m.canary_routed.labels("v2").inc()
    m.slo.labels("interactive", "met").inc()
    m.held.set(0)
    m.disaggregated.labels("ok").inc()
    m.lane_holds.labels("long").inc()
    m.fit_tokens.labels("default", "m", "now").set(1)
    m.preemptions.labels("low").inc()
    m.resumes.labels("resumed").inc()
    m.scale_waiting.set(0)
    # the autoscaling panel reads kvgate autoscale's own /metrics
    from prometheus_client import generate_latest

    from analytics.autoscale import AutoscaleSettings
    from analytics.autoscaler import AutoscaleService
    from streams.settings import KafkaSettings
    from tests.factories import heartbeat

    scaler = AutoscaleService(KafkaSettings(), AutoscaleSettings(), bus=None)  # type: ignore[arg-type]
    scaler.ingest([heartbeat("n1")])
    scaler.tick(time.time())
    text = m.render().decode() + generate_latest(scaler.registry).decode()
    exported = set(re.findall(r"^(kvgate_[a-z_]+)", text, re.MULTILINE))
    for panel in PROM_DASHBOARD:
        for expr, _ in panel.exprs:
            names = set(re.findall(r"kvgate_[a-z_]+", expr))
            assert names and names <= exported, (panel.title, names - exported)
