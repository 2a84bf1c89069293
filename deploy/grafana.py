"""Grafana dashboards as code: kvgate's panels over the ClickHouse decision log.

The panels are data (:data:`DASHBOARDS`, deploy/grafana_panels.py); :func:`build` turns them
into Grafana dashboard JSON for the ClickHouse data source plugin
(``grafana-clickhouse-datasource``, v4), written under ``deploy/grafana/dashboards/`` by
``kvgate grafana build`` and published by ``kvgate grafana push`` (with ``grafana-client``, the
maintained fork of ``grafana-api``, which has had no release since 2020). :func:`expand` applies
the plugin's macros the way the plugin does, so every panel's query can be run against
ClickHouse without Grafana (``kvgate grafana check`` and the tests do).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.grafana_panels import DASHBOARDS, TENANT, Dashboard, Panel

__all__ = [
    "DASHBOARDS",
    "DATASOURCE_TYPE",
    "Dashboard",
    "Panel",
    "build",
    "dashboard_json",
    "datasource_model",
    "expand",
    "grid",
    "panel_queries",
    "push",
    "write_dashboards",
]

DATASOURCE_TYPE = "grafana-clickhouse-datasource"
DATASOURCE_UID = "kvgate-clickhouse"
DATASOURCE = {"type": DATASOURCE_TYPE, "uid": "${datasource}"}
HERE = Path(__file__).parent / "grafana"
# the plugin's query formats (its `Format` enum)
_FORMAT = {"timeseries": 0, "table": 1}


_VARIABLES: dict[str, dict[str, Any]] = {
    "tenant": {
        "type": "query",
        "name": "tenant",
        "label": "tenant",
        "datasource": DATASOURCE,
        "query": "SELECT DISTINCT tenant FROM {db}.decisions ORDER BY tenant",
        "includeAll": True,
        "allValue": ".*",
        "multi": False,
        "refresh": 2,
        "current": {"text": "All", "value": "$__all"},
    },
    "ttft_slo_s": {
        "type": "textbox",
        "name": "ttft_slo_s",
        "label": "TTFT target (s)",
        "query": "2",
        "current": {"text": "2", "value": "2"},
    },
    "tpot_slo_s": {
        "type": "textbox",
        "name": "tpot_slo_s",
        "label": "TPOT target (s)",
        "query": "0.1",
        "current": {"text": "0.1", "value": "0.1"},
    },
}


def _panel(p: Panel, pid: int, x: int, y: int, db: str) -> dict[str, Any]:
    targets = [
        {
            "refId": chr(ord("A") + i),
            "datasource": DATASOURCE,
            "editorType": "sql",
            "queryType": q.kind,
            "format": _FORMAT[q.kind],
            "rawSql": q.sql.replace("{db}", db).replace("{tenant}", TENANT),
        }
        for i, q in enumerate(p.queries)
    ]
    custom: dict[str, Any] = {}
    if p.type == "timeseries":
        custom = {"drawStyle": "line", "fillOpacity": 20 if p.stack else 0, "showPoints": "never"}
        if p.stack:
            custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "id": pid,
        "type": p.type,
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": p.w, "h": p.h},
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": p.unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"}},
    }


def grid(sizes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Positions (x, y) of panels of (width, height), left to right in rows of 24 columns."""
    out = []
    x = y = row_h = 0
    for w, h in sizes:
        if x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        out.append((x, y))
        x += w
        row_h = max(row_h, h)
    return out


def dashboard_json(
    uid: str,
    title: str,
    description: str,
    tags: list[str],
    variables: list[dict[str, Any]],
    panels: list[dict[str, Any]],
) -> dict[str, Any]:
    """The dashboard envelope every kvgate dashboard shares."""
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": tags,
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables},
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def build(d: Dashboard, db: str = "kvgate") -> dict[str, Any]:
    """Grafana's dashboard JSON for ``d`` (queries against database ``db``)."""
    places = grid([(p.w, p.h) for p in d.panels])
    panels = [
        _panel(p, i, x, y, db)
        for i, (p, (x, y)) in enumerate(zip(d.panels, places, strict=True), start=1)
    ]
    variables: list[dict[str, Any]] = [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "ClickHouse",
            "query": DATASOURCE_TYPE,
            "current": {"text": "kvgate ClickHouse", "value": DATASOURCE_UID},
        }
    ]
    for name in d.variables:
        v = dict(_VARIABLES[name])
        if isinstance(v.get("query"), str):
            v["query"] = v["query"].replace("{db}", db)
        variables.append(v)
    return dashboard_json(d.uid, d.title, d.description, list(d.tags), variables, panels)


def write_dashboards(out: Path = HERE / "dashboards", db: str = "kvgate") -> list[Path]:
    """The ClickHouse dashboards and the Prometheus one (:mod:`deploy.grafana_prom`)."""
    from deploy.grafana_prom import UID, build_prometheus

    out.mkdir(parents=True, exist_ok=True)
    models = [(d.uid, build(d, db)) for d in DASHBOARDS] + [(UID, build_prometheus())]
    paths = []
    for uid, model in models:
        path = out / f"{uid}.json"
        path.write_text(json.dumps(model, indent=2, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths


# --- the plugin's macros ------------------------------------------------------------------
_MACRO = re.compile(r"\$__(timeFilter|timeInterval)\(([^)]+)\)")
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def expand(
    sql: str,
    from_s: float,
    to_s: float,
    interval_s: int,
    variables: Mapping[str, str] | None = None,
) -> str:
    """``sql`` as the ClickHouse plugin sends it: ``$__timeFilter(col)``,
    ``$__timeInterval(col)``, ``$__fromTime``, ``$__toTime``, ``$__interval_s`` and dashboard
    variables (``${name}`` / ``$name``) replaced."""
    start, end = f"toDateTime({int(from_s)})", f"toDateTime({int(to_s)})"

    def macro(m: re.Match[str]) -> str:
        col = m.group(2).strip()
        if m.group(1) == "timeFilter":
            return f"{col} >= {start} AND {col} <= {end}"
        return f"toStartOfInterval(toDateTime({col}), INTERVAL {interval_s} second)"

    sql = _MACRO.sub(macro, sql)
    sql = sql.replace("$__fromTime", start).replace("$__toTime", end)
    sql = sql.replace("$__interval_s", str(interval_s))
    values = dict(variables or {})

    def var(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"no value for dashboard variable {name!r}")
        return values[name]

    return _VAR.sub(var, sql)


def panel_queries(db: str, from_s: float, to_s: float) -> list[tuple[str, str]]:
    """Every panel query of every dashboard, expanded for the range with the default variables:
    (``dashboard / panel [refId]``, SQL)."""
    out = []
    for d in DASHBOARDS:
        for panel in build(d, db)["panels"]:
            for t in panel["targets"]:
                sql = expand(t["rawSql"], from_s, to_s, 60, default_variables())
                out.append((f"{d.uid} / {panel['title']} [{t['refId']}]", sql))
    return out


def default_variables() -> dict[str, str]:
    """The values a fresh dashboard starts with (All tenants, the default SLO targets)."""
    return {"tenant": ".*", "ttft_slo_s": "2", "tpot_slo_s": "0.1", "datasource": DATASOURCE_UID}


# --- publishing -----------------------------------------------------------------------------
def datasource_model(
    host: str, port: int, database: str, username: str, protocol: str, secure: bool
) -> dict[str, Any]:
    """The ClickHouse data source as Grafana's API and provisioning files take it."""
    return {
        "name": "kvgate ClickHouse",
        "uid": DATASOURCE_UID,
        "type": DATASOURCE_TYPE,
        "access": "proxy",
        "jsonData": {
            "host": host,
            "port": port,
            "protocol": protocol,
            "secure": secure,
            "username": username,
            "defaultDatabase": database,
        },
    }


@dataclass(slots=True)
class PushReport:
    grafana_version: str = ""
    datasource: str = ""
    folder: str = ""
    dashboards: list[str] = field(default_factory=list)


def push(
    url: str,
    token: str | None,
    datasource: dict[str, Any] | None,
    password: str | None = None,
    folder_title: str = "kvgate",
    db: str = "kvgate",
    timeout_s: float = 10.0,
) -> PushReport:
    """Publish the data source (when given), a folder and every dashboard to the Grafana at
    ``url`` (``http://user:pass@host:3000`` or a service-account ``token``). Idempotent: an
    existing data source is updated, dashboards are overwritten."""
    from grafana_client.api import GrafanaApi
    from grafana_client.client import GrafanaClientError

    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    report = PushReport()
    build_info = api.health.check() or {}
    report.grafana_version = str(build_info.get("version", "?"))
    if datasource is not None:
        body = dict(datasource)
        if password:
            body["secureJsonData"] = {"password": password}
        try:
            api.datasource.get_datasource_by_uid(DATASOURCE_UID)
            api.datasource.update_datasource_by_uid(DATASOURCE_UID, body)
            report.datasource = "updated"
        except GrafanaClientError as exc:
            if exc.status_code != 404:
                raise
            api.datasource.create_datasource(body)
            report.datasource = "created"
    folder_uid = "kvgate"
    try:
        api.folder.get_folder(folder_uid)
        report.folder = "exists"
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
        api.folder.create_folder(folder_title, uid=folder_uid)
        report.folder = "created"
    for d in DASHBOARDS:
        res = api.dashboard.update_dashboard(
            {
                "dashboard": build(d, db),
                "folderUid": folder_uid,
                "overwrite": True,
                "message": "kvgate grafana push",
            }
        )
        report.dashboards.append(str(res.get("url") or d.uid))
    return report
