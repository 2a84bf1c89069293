"""The container image and the compose system, validated without a container engine.

The compose file is loaded by compose-go — the library ``docker compose`` itself uses — through
``deploy/compose/check`` (schema validation, interpolation, merge keys, normalization, the
consistency of ``depends_on``); the tests then check what only kvgate knows: every kvgate
service runs a real ``kvgate`` command with real options, its environment is valid kvgate
settings, and ports, endpoints and scrape targets agree with each other. The Dockerfile is read
as text: multi-stage, non-root, health-checked, and it copies every package the project has.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from deploy.settings import load_settings
from tests.deploykit import ROOT, assert_known_sections, assert_real_command, go_build, options

COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"
CHECKER = ROOT / "deploy" / "compose" / "check"
IMAGE = "kvgate:local"


@pytest.fixture(scope="module")
def checker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return go_build(CHECKER, tmp_path_factory.mktemp("bin") / "composecheck")


def load(checker: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(checker), str(path)], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def project(checker: Path) -> dict[str, Any]:
    done = load(checker, COMPOSE)
    assert done.returncode == 0, done.stderr
    loaded: dict[str, Any] = json.loads(done.stdout)
    return loaded


def kvgate_services(project: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, svc in project["services"].items():
        if svc.get("image") == IMAGE:
            yield name, svc


def test_the_loader_rejects_what_docker_compose_would(checker: Path, tmp_path: Path) -> None:
    bad = yaml.safe_load(COMPOSE.read_text())
    bad["services"]["router-a"]["comand"] = ["router"]  # not a key of the specification
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(bad))
    done = load(checker, tmp_path / "compose.yaml")
    assert done.returncode == 1 and "comand" in done.stderr
    bad = yaml.safe_load(COMPOSE.read_text())
    bad["services"]["agent-1"]["depends_on"]["engine-9"] = {"condition": "service_healthy"}
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(bad))
    done = load(checker, tmp_path / "compose.yaml")
    assert done.returncode == 1 and "engine-9" in done.stderr


def test_the_whole_system_is_there(project: dict[str, Any]) -> None:
    services = project["services"]
    for infra in ("kafka", "redis", "clickhouse", "prometheus", "grafana"):
        assert infra in services
    commands = [svc["command"][0] for _, svc in kvgate_services(project)]
    assert commands.count("router") == 2
    assert {"worker", "sink", "engine", "agent"} <= set(commands)
    assert commands.count("engine") == commands.count("agent") >= 2
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert (
        "grafana-clickhouse-datasource" in services["grafana"]["environment"]["GF_INSTALL_PLUGINS"]
    )


def test_every_service_runs_a_real_command_with_realoptions(project: dict[str, Any]) -> None:
    for name, svc in kvgate_services(project):
        assert_real_command(svc["command"], name)


def test_every_environment_is_valid_settings(
    project: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, svc in kvgate_services(project):
        env = {k: v for k, v in svc["environment"].items() if k.startswith("KVGATE_")}
        for key in list(os.environ):
            if key.startswith("KVGATE_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        s = load_settings()  # raises on an unknown field or a bad value
        assert_known_sections(env, name)
        if "KVGATE_KAFKA__BOOTSTRAP_SERVERS" in env:
            assert s.kafka.bootstrap_servers.split(":")[0] in project["services"], name
        if "KVGATE_REDIS__URL" in env:
            assert urlparse(s.redis.url).hostname in project["services"], name
        if env.get("KVGATE_CLICKHOUSE__BACKEND") == "server":
            assert s.clickhouse.host in project["services"], name


def _port(svc: dict[str, Any]) -> int:
    return int(options(svc["command"][1:])["--port"])


def test_ports_endpoints_and_scrape_targets_agree(project: dict[str, Any]) -> None:
    services = project["services"]
    http_port: dict[str, int] = {}
    for name, svc in kvgate_services(project):
        kind = svc["command"][0]
        assert svc.get("read_only") is True and "/tmp" in svc.get("tmpfs", []), name
        if kind in ("router", "engine"):
            port = http_port[name] = _port(svc)
            assert options(svc["command"][1:])["--host"] == "0.0.0.0", name
            health = urlparse(svc["environment"]["KVGATE_HEALTH_URL"])
            assert health.port == port and health.path == "/health", name
            for published in svc.get("ports", []):
                assert published["target"] == port, name
        if kind == "agent":
            opts = options(svc["command"][1:])
            engine = urlparse(opts["--engine-url"])
            assert engine.hostname in services, name
            target = services[engine.hostname]
            assert target["command"][0] == "engine" and engine.port == _port(target), name
            assert engine.hostname in svc["depends_on"], name
            env = target["environment"]
            for flag, key in (
                ("--kv-events", "KVGATE_ENGINE__KV_EVENTS_ENDPOINT"),
                ("--kv-events-replay", "KVGATE_ENGINE__KV_EVENTS_REPLAY_ENDPOINT"),
            ):
                assert urlparse(opts[flag]).port == urlparse(env[key]).port, (name, flag)
                assert urlparse(opts[flag]).hostname == engine.hostname, (name, flag)
        env = svc["environment"]
        for key, port in env.items():  # agents, worker and sink serve /metrics on their own
            if not key.endswith(("__METRICS_PORT", "__WEB_PORT")):
                continue
            assert env[key.removesuffix("_PORT") + "_HOST"] == "0.0.0.0", name
            http_port[name] = int(port)
            if "KVGATE_HEALTH_URL" in env:
                health = urlparse(env["KVGATE_HEALTH_URL"])
                assert health.port == int(port) and health.path == "/health", name
    scrape = yaml.safe_load((COMPOSE.parent / "prometheus.yml").read_text())
    targets = {
        t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    }
    assert targets == {f"{n}:{p}" for n, p in http_port.items()}
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), (name, volume["source"])


def _stages(dockerfile: str) -> list[list[str]]:
    stages: list[list[str]] = []
    for line in re.sub(r"\\\n", " ", dockerfile).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_the_image_is_multi_stage_non_root_and_health_checked() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = _stages(text)
    assert len(stages) >= 2
    final = stages[-1]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    user = next(line.split()[1] for line in final if line.startswith("USER "))
    uid = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], user).split(":")[0]
    assert uid.isdigit() and int(uid) >= 10000  # numeric: runAsNonRoot can check it
    assert any(line.startswith("HEALTHCHECK") and "deploy.healthcheck" in line for line in final)
    assert any(line.startswith("ENTRYPOINT") and "kvgate" in line for line in final)
    assert any("COPY --from=" in line for line in final)
    env = " ".join(line for line in final if line.startswith("ENV "))
    for writable in ("HOME=/tmp", "KVGATE_LOCAL=/tmp", "KVGATE_WORKER__DATA_DIR=/tmp"):
        assert writable in env  # a read-only root filesystem needs only /tmp
    project_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in project_cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied = {
        line.split()[1]
        for line in stages[0]
        if line.startswith("COPY ") and not line.startswith("COPY --")
    }
    assert packages <= copied, packages - copied
    assert any('pip install ".[all]"' in line for line in stages[0])  # every component's extras
    for src in copied:
        assert (ROOT / src).exists(), src
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not packages & set(ignored) and "README.md" not in ignored


async def test_the_health_check_answers_for_a_component() -> None:
    from aiohttp import web

    from deploy.healthcheck import check
    from tests.edgekit import _serve

    app_ = web.Application()
    app_.router.add_get("/health", lambda _: web.Response(text="ok"))
    app_.router.add_get("/down", lambda _: web.Response(status=503))
    runner, url = await _serve(app_)
    try:
        loop = __import__("asyncio").get_running_loop()
        assert await loop.run_in_executor(None, check, url + "/health")
        assert not await loop.run_in_executor(None, check, url + "/down")
        assert not await loop.run_in_executor(None, check, "http://127.0.0.1:1/health")
        assert not await loop.run_in_executor(None, check, "file:///etc/passwd")
        assert check(None)  # components without HTTP
    finally:
        await runner.cleanup()
