"""The Helm chart (``deploy/helm/kvgate``): it lints, renders, and what it renders decodes
strictly into Kubernetes' own Go types (client-go's scheme, prometheus-operator's for the
monitoring objects — ``deploy/helm/check``); then the tests check what only kvgate knows: the
commands and options, the settings file and the key variables, probes, selectors, the sidecar,
and that the monitoring objects carry kvgate's real rules and dashboards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.grafana import write_dashboards
from deploy.settings import load_settings
from tests.deploykit import ROOT, assert_known_sections, assert_real_command, go_build, options

CHART = ROOT / "deploy" / "helm" / "kvgate"
ALL_ON = [
    "--set",
    "simEngines.enabled=true",
    "--set",
    "monitoring.serviceMonitor.enabled=true",
    "--set",
    "monitoring.prometheusRule.enabled=true",
    "--set",
    "monitoring.grafanaDashboards.enabled=true",
    "--set-json",
    'secrets.tenants={"sk-chat": {"name": "chat", "priority": "high"}}',
    "--set-json",
    'secrets.gatewayKeys={"gw-key-0123": "envoy"}',
    "--set",
    "secrets.clickhousePassword=pw",
    "--set",
    "epp.enabled=true",
    "--set",
    "inferencePool.enabled=true",
    "--set",
    "autoscale.enabled=true",
    "--set",
    "keda.enabled=true",
]
# custom resources without Go types here: checked against their documented API below
UNTYPED = ["InferencePool", "ScaledObject"]


def _helm() -> str:
    local = Path(os.environ.get("KVGATE_LOCAL", ROOT / ".local")) / "bin" / "helm"
    found = os.environ.get("KVGATE_HELM") or (str(local) if local.exists() else None)
    found = found or shutil.which("helm")
    assert found, "helm is needed (deploy/setup.sh builds it with go install)"
    return found


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_helm(), *args], capture_output=True, text=True, check=False)


def render(*extra: str) -> list[dict[str, Any]]:
    done = helm("template", "kv", str(CHART), "--namespace", "llm", *extra)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def k8scheck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return go_build(CHART.parent / "check", tmp_path_factory.mktemp("bin") / "k8scheck")


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render(*ALL_ON)


def one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [(o["kind"], o["metadata"]["name"]) for o in objs])
    return found[0]


def containers(objs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            for c in o["spec"]["template"]["spec"]["containers"]:
                yield f"{o['metadata']['name']}/{c['name']}", c


def test_the_chart_lints_and_renders_into_kubernetes_types(k8scheck: Path) -> None:
    for extra in ([], ALL_ON):
        done = helm("lint", "--strict", str(CHART), *extra)
        assert done.returncode == 0, done.stdout + done.stderr
        rendered = helm("template", "kv", str(CHART), *extra)
        assert rendered.returncode == 0, rendered.stderr
        checked = subprocess.run(
            [str(k8scheck), *UNTYPED],
            input=rendered.stdout,
            capture_output=True,
            text=True,
            check=False,
        )
        assert checked.returncode == 0, checked.stderr
    # and the checker is strict: a field Kubernetes does not have is an error
    bad = rendered.stdout.replace("readinessProbe:", "readinesProbe:", 1)
    checked = subprocess.run(
        [str(k8scheck)], input=bad, capture_output=True, text=True, check=False
    )
    assert checked.returncode == 1 and "readinesProbe" in checked.stderr


def test_every_object_is_there(objects: list[dict[str, Any]]) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for kind, name in [
        ("Deployment", "kv-kvgate-router"),
        ("Service", "kv-kvgate-router"),
        ("PodDisruptionBudget", "kv-kvgate-router"),
        ("HorizontalPodAutoscaler", "kv-kvgate-router"),
        ("Deployment", "kv-kvgate-worker"),
        ("Deployment", "kv-kvgate-sink"),
        ("ConfigMap", "kv-kvgate-config"),
        ("Secret", "kv-kvgate-keys"),
        ("NetworkPolicy", "kv-kvgate-router"),
        ("ServiceMonitor", "kv-kvgate-router"),
        ("PrometheusRule", "kv-kvgate"),
        ("StatefulSet", "kv-kvgate-sim-engine"),
        ("InferencePool", "kv-kvgate"),
        ("Deployment", "kv-kvgate-autoscale"),
        ("ScaledObject", "kv-kvgate-engines"),
    ]:
        assert (kind, name) in kinds
    # off by default: monitoring CRDs (they need prometheus-operator) and simulated engines
    default = {o["kind"] for o in render()}
    assert not default & {
        "ServiceMonitor",
        "PrometheusRule",
        "StatefulSet",
        "InferencePool",
        "ScaledObject",
    }
    assert ("Deployment", "kv-kvgate-autoscale") not in {
        (o["kind"], o["metadata"]["name"]) for o in render()
    }
    # KEDA's ScaledObject (keda.sh/v1alpha1): the documented fields, the signal's gauge
    so = one(objects, "ScaledObject", "kv-kvgate-engines")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert set(so["spec"]) == {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "triggers",
    }
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
    assert trigger["metadata"]["query"].startswith("max(kvgate_autoscale_desired_replicas{")
    done = helm("template", "kv", str(CHART), "--set", "keda.enabled=true")
    assert done.returncode != 0 and "autoscale.enabled" in done.stderr
    # a pool without the picker it points at is refused at render time
    done = helm("template", "kv", str(CHART), "--set", "inferencePool.enabled=true")
    assert done.returncode != 0 and "epp.enabled" in done.stderr


def test_every_container_runs_a_real_command_securely(objects: list[dict[str, Any]]) -> None:
    for where, c in containers(objects):
        assert_real_command(c["args"], where)
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"], where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], where
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            pod = o["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"]


def test_the_router_is_probed_served_and_selected(objects: list[dict[str, Any]]) -> None:
    dep = one(objects, "Deployment", "kv-kvgate-router")
    assert "replicas" not in dep["spec"]  # the HPA owns it
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    port = int(options(c["args"][1:])["--port"])
    assert options(c["args"][1:])["--host"] == "0.0.0.0"
    assert {"name": "http", "containerPort": port} in c["ports"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    svc = one(objects, "Service", "kv-kvgate-router")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        obj = one(objects, kind, "kv-kvgate-router")
        sel = obj["spec"].get("selector") or obj["spec"]["podSelector"]
        assert sel["matchLabels"].items() <= pod_labels.items(), kind
    hpa = one(objects, "HorizontalPodAutoscaler", "kv-kvgate-router")
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    sm = one(objects, "ServiceMonitor", "kv-kvgate-router")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}


def test_settings_and_keys_load_as_kvgate_settings(
    objects: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = one(objects, "ConfigMap", "kv-kvgate-config")["data"]["kvgate.yaml"]
    (tmp_path / "kvgate.yaml").write_text(config)
    secret = one(objects, "Secret", "kv-kvgate-keys")
    for where, c in containers(objects):
        for key in list(os.environ):
            if key.startswith("KVGATE_"):
                monkeypatch.delenv(key)
        env: dict[str, str] = {}
        for var in c.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "secretKeyRef" in var.get("valueFrom", {}):
                ref = var["valueFrom"]["secretKeyRef"]
                assert ref["name"] == secret["metadata"]["name"], where
                value = secret["stringData"].get(ref["key"])
                assert value is not None or ref.get("optional"), (where, ref)
                if value is not None:
                    env[var["name"]] = value
        assert_known_sections(env, where)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        if "KVGATE_CONFIG" not in env:  # a simulated engine: its own few settings
            load_settings()
            continue
        s = load_settings(tmp_path / "kvgate.yaml")
        assert s.admission.backend == "redis" and s.worker.exactly_once
        assert s.clickhouse.password.get_secret_value() == "pw"
        assert s.admission.tenants["sk-chat"].priority == "high", where
        assert s.router.gateway_keys == {"gw-key-0123": "envoy"}, where


def test_an_existing_secret_is_used_as_is() -> None:
    objs = render("--set", "secrets.existingSecret=mine")
    assert not [o for o in objs if o["kind"] == "Secret"]
    for where, c in containers(objs):
        refs = [
            v["valueFrom"]["secretKeyRef"]["name"]
            for v in c["env"]
            if "secretKeyRef" in v.get("valueFrom", {})
        ]
        assert refs and set(refs) == {"mine"}, where


def test_the_agent_sidecar_scrapes_locally_and_advertises_the_pod(
    objects: list[dict[str, Any]],
) -> None:
    sts = one(objects, "StatefulSet", "kv-kvgate-sim-engine")
    pod = {c["name"]: c for c in sts["spec"]["template"]["spec"]["containers"]}
    engine, agent = pod["engine"], pod["kvgate-agent"]
    opts = options(agent["args"][1:])
    port = int(options(engine["args"][1:])["--port"])
    assert opts["--engine-url"] == f"http://127.0.0.1:{port}"
    assert opts["--advertise-url"] == f"http://$(POD_IP):{port}"
    assert opts["--node-id"] == "$(POD_NAME)"
    refs = {v["name"]: v["valueFrom"]["fieldRef"]["fieldPath"] for v in agent["env"][:2]}
    assert refs == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
    engine_env = {v["name"]: v.get("value") for v in engine["env"]}
    for flag, key in (
        ("--kv-events", "KVGATE_ENGINE__KV_EVENTS_ENDPOINT"),
        ("--kv-events-replay", "KVGATE_ENGINE__KV_EVENTS_REPLAY_ENDPOINT"),
    ):
        assert opts[flag] == engine_env[key], flag


def test_monitoring_carries_kvgates_rules_and_dashboards(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    rules = yaml.safe_load((CHART / "files" / "kvgate-rules.yaml").read_text())
    assert one(objects, "PrometheusRule", "kv-kvgate")["spec"] == rules
    generated = {p.name: json.loads(p.read_text()) for p in write_dashboards(tmp_path)}
    shipped = {
        p.name: json.loads(p.read_text()) for p in (CHART / "files" / "dashboards").glob("*.json")
    }
    assert shipped == generated, (
        "stale: kvgate grafana build --out deploy/helm/kvgate/files/dashboards"
    )
    maps = [o for o in objects if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]]
    assert len(maps) == len(generated)
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, body),) = cm["data"].items()
        assert json.loads(body) == generated[name]


def test_the_inference_pool_points_at_the_routers_picker(objects: list[dict[str, Any]]) -> None:
    """Fields as the inference.networking.k8s.io/v1 API reference defines them (InferencePool:
    spec.selector.matchLabels, targetPorts[].number, endpointPickerRef {name, port.number,
    failureMode FailOpen|FailClose}); no Go types of it are available to decode into."""
    pool = one(objects, "InferencePool", "kv-kvgate")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    assert spec["selector"] == {"matchLabels": {"app": "vllm"}}
    assert spec["targetPorts"] == [{"number": 8000}]
    ref = spec["endpointPickerRef"]
    assert set(ref) == {"name", "port", "failureMode"} and ref["failureMode"] in (
        "FailOpen",
        "FailClose",
    )
    svc = one(objects, "Service", ref["name"])
    grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc-epp")
    assert ref["port"] == {"number": grpc_port["port"]}
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    dep = one(objects, "Deployment", "kv-kvgate-router")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert options(c["args"][1:])["--epp-port"] == str(grpc_port["port"])
    assert {"name": "grpc-epp", "containerPort": grpc_port["port"]} in c["ports"]


def test_components_serve_metrics_the_pod_monitor_finds(objects: list[dict[str, Any]]) -> None:
    monitor = one(objects, "PodMonitor", "kv-kvgate-components")
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    found = set()
    for o in objects:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        labels = o["spec"]["template"]["metadata"]["labels"]
        for c in o["spec"]["template"]["spec"]["containers"]:
            env = {v["name"]: v.get("value") for v in c.get("env", [])}
            for p in c.get("ports", []):
                if p["name"] in ports:
                    assert selector.items() <= labels.items(), o["metadata"]["name"]
                    port_vars = [k for k in env if k.endswith(("__METRICS_PORT", "__WEB_PORT"))]
                    assert [env[k] for k in port_vars] == [str(p["containerPort"])], c["name"]
                    found.add(c["name"])
    assert {"sink", "worker", "kvgate-agent"} <= found
