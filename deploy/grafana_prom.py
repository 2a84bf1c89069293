"""The router's live health on Prometheus: a Grafana dashboard over the routers' ``/metrics``
(next to the ClickHouse dashboards of :mod:`deploy.grafana`, which read the decision log).

Written with the others by ``kvgate grafana build`` (``kvgate-router-prometheus.json``); it
needs a Prometheus data source (picked with the dashboard's ``prometheus`` variable; the compose
system and the chart's Grafana provisioning name theirs ``kvgate-prometheus``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PROM_DASHBOARD", "PromPanel", "build_prometheus"]

UID = "kvgate-router-prometheus"
DATASOURCE = {"type": "prometheus", "uid": "${prometheus}"}
RATE = "[$__rate_interval]"


@dataclass(frozen=True, slots=True)
class PromPanel:
    title: str
    exprs: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    type: str = "timeseries"
    w: int = 8
    h: int = 8


def _quantiles(metric: str, by: str = "") -> tuple[tuple[str, str], ...]:
    group = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{RATE})))",
            f"{legend}p{int(q * 100)}",
        )
        for q in (0.5, 0.99)
    )


PROM_DASHBOARD: tuple[PromPanel, ...] = (
    PromPanel(
        "Finished requests / s by status",
        (("sum by (status) (rate(kvgate_router_outcomes_total" + RATE + "))", "{{status}}"),),
        "reqps",
    ),
    PromPanel(
        "Refusals / s by reason",
        (("sum by (reason) (rate(kvgate_router_rejections_total" + RATE + "))", "{{reason}}"),),
        "reqps",
    ),
    PromPanel(
        "Routing decisions / s by reason",
        (("sum by (reason) (rate(kvgate_router_decisions_total" + RATE + "))", "{{reason}}"),),
        "reqps",
    ),
    PromPanel("Time to first token", _quantiles("kvgate_router_ttft_seconds"), "s"),
    PromPanel("Time per output token", _quantiles("kvgate_router_tpot_seconds"), "s"),
    PromPanel(
        "Decision time (without queueing)", _quantiles("kvgate_router_decision_seconds"), "s"
    ),
    PromPanel(
        "Admission queue wait by priority",
        _quantiles("kvgate_router_admission_queue_wait_seconds", "priority"),
        "s",
    ),
    PromPanel(
        "Queued and in flight by priority",
        (
            ("sum by (priority) (kvgate_router_admission_queue_depth)", "queued {{priority}}"),
            ("sum by (priority) (kvgate_router_inflight_requests)", "in flight {{priority}}"),
        ),
    ),
    PromPanel(
        "KV budget in use by pool",
        (("max by (pool) (kvgate_router_kv_budget_used_ratio)", "{{pool}}"),),
        "percentunit",
    ),
    PromPanel(
        "Largest prompt one node can take (tokens): now and ever",
        (
            (
                'max by (pool, model) (kvgate_router_fit_tokens{when="now"})',
                "now {{pool}} {{model}}",
            ),
            (
                'max by (pool, model) (kvgate_router_fit_tokens{when="ever"})',
                "ever {{pool}} {{model}}",
            ),
        ),
    ),
    PromPanel(
        "Autoscaling: desired and serving replicas, forecast arrivals",
        (
            ("max by (pool, model) (kvgate_autoscale_desired_replicas)", "desired {{model}}"),
            ("max by (pool, model) (kvgate_autoscale_serving_replicas)", "serving {{model}}"),
            ("max by (pool, model) (kvgate_autoscale_forecast_rps)", "forecast req/s {{model}}"),
        ),
    ),
    PromPanel(
        "Tokens / s",
        (("sum by (kind) (rate(kvgate_router_tokens_total" + RATE + "))", "{{kind}}"),),
    ),
    PromPanel(
        "Prompt tokens served from cache",
        (
            (
                'sum(rate(kvgate_router_tokens_total{kind="cached"}' + RATE + ")) / "
                'sum(rate(kvgate_router_tokens_total{kind="prompt"}' + RATE + "))",
                "cached share",
            ),
        ),
        "percentunit",
    ),
    PromPanel(
        "Nodes",
        (
            ("max by (state) (kvgate_router_nodes)", "{{state}}"),
            ("max by (kv_index) (kvgate_router_nodes_kv_index)", "index: {{kv_index}}"),
        ),
    ),
    PromPanel(
        "Fleet: drained, ejected, probing, slow start, canary",
        (("max by (state) (kvgate_router_fleet_nodes)", "{{state}}"),),
    ),
    PromPanel(
        "Ejections / s by cause",
        (("sum by (cause) (rate(kvgate_router_ejections_total" + RATE + "))", "{{cause}}"),),
    ),
    PromPanel(
        "SLO attainment by class",
        (
            (
                'sum by (slo_class) (rate(kvgate_router_slo_requests_total{outcome="met"}'
                + RATE
                + ")) / sum by (slo_class) (rate(kvgate_router_slo_requests_total"
                + '{outcome=~"met|missed"}'
                + RATE
                + "))",
                "{{slo_class}}",
            ),
        ),
        "percentunit",
    ),
    PromPanel(
        "SLO classes: refused early / s and held",
        (
            (
                'sum by (slo_class) (rate(kvgate_router_slo_requests_total{outcome="refused"}'
                + RATE
                + "))",
                "refused {{slo_class}}",
            ),
            ("sum(kvgate_router_held_requests)", "held now"),
        ),
    ),
    PromPanel(
        "Preemptions, stream resumes / s and requests waiting for a scale-up",
        (
            (
                "sum by (priority) (rate(kvgate_router_preemptions_total" + RATE + "))",
                "preempted {{priority}} / s",
            ),
            (
                "sum by (result) (rate(kvgate_router_stream_resumes_total" + RATE + "))",
                "stream resumes {{result}} / s",
            ),
            ("sum(kvgate_router_scale_waiting)", "waiting for a scale-up now"),
        ),
    ),
    PromPanel(
        "Lanes: requests in the router's queue, and queued / s by lane",
        (
            ("sum(kvgate_router_lane_queue_requests)", "in the queue now"),
            (
                "sum by (lane) (rate(kvgate_router_lane_holds_total" + RATE + "))",
                "queued {{lane}} / s",
            ),
        ),
    ),
    PromPanel(
        "Disaggregated requests / s by prefill outcome",
        (
            (
                "sum by (outcome) (rate(kvgate_router_disaggregated_total" + RATE + "))",
                "{{outcome}}",
            ),
        ),
        "reqps",
    ),
    PromPanel(
        "Canary requests / s by group",
        (("sum by (group) (rate(kvgate_router_canary_requests_total" + RATE + "))", "{{group}}"),),
        "reqps",
    ),
    PromPanel(
        "Feed and Kafka",
        (
            ("max(kvgate_router_replica_lag_seconds)", "replica lag (s)"),
            ("sum(kvgate_router_kafka_queued)", "Kafka outbox"),
            ("max by (mode) (kvgate_router_degraded)", "degraded: {{mode}}"),
        ),
    ),
    PromPanel(
        "Reservations held",
        (("max(kvgate_router_reservations)", "reservations"),),
    ),
    PromPanel(
        "Tokenization mismatches / s",
        (
            (
                "sum by (model) (rate(kvgate_tokenization_mismatches_total" + RATE + "))",
                "{{model}}",
            ),
        ),
    ),
)


def _panel(p: PromPanel, pid: int, x: int, y: int) -> dict[str, Any]:
    targets = [
        {
            "refId": chr(ord("A") + i),
            "datasource": DATASOURCE,
            "expr": expr,
            "legendFormat": legend,
            "range": True,
        }
        for i, (expr, legend) in enumerate(p.exprs)
    ]
    return {
        "id": pid,
        "type": p.type,
        "title": p.title,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": p.w, "h": p.h},
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "unit": p.unit,
                "custom": {"drawStyle": "line", "fillOpacity": 0, "showPoints": "never"},
            },
            "overrides": [],
        },
        "options": {"legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"}},
    }


def build_prometheus() -> dict[str, Any]:
    """Grafana's dashboard JSON of :data:`PROM_DASHBOARD`."""
    from deploy.grafana import dashboard_json, grid

    places = grid([(p.w, p.h) for p in PROM_DASHBOARD])
    panels = [
        _panel(p, i, x, y)
        for i, (p, (x, y)) in enumerate(zip(PROM_DASHBOARD, places, strict=True), start=1)
    ]
    variable = {
        "type": "datasource",
        "name": "prometheus",
        "label": "Prometheus",
        "query": "prometheus",
        "current": {"text": "kvgate Prometheus", "value": "kvgate-prometheus"},
    }
    return dashboard_json(
        UID,
        "kvgate — router (Prometheus)",
        "The routers' live health from their /metrics: traffic, refusals, latencies, queues, "
        "KV budget, cache share, fleet (drains, ejections, canaries), SLO classes, lanes, "
        "disaggregation, feed",
        ["kvgate", "prometheus"],
        [variable],
        panels,
    )
