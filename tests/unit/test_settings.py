from pathlib import Path

import pytest
from pydantic import ValidationError

from deploy.settings import load_settings
from streams.settings import KafkaSettings


def test_env_overrides_file_and_nested_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text("kafka:\n  namespace: fromfile\n  partitions: 8\nrouter:\n  port: 9000\n")
    monkeypatch.setenv("KVGATE_KAFKA__NAMESPACE", "fromenv")
    s = load_settings(cfg)
    assert s.kafka.namespace == "fromenv"
    assert s.kafka.partitions == 8
    assert s.router.port == 9000


def test_invalid_settings_are_rejected_at_load(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("kafka:\n  partitions: 0\n")
    with pytest.raises(ValidationError):
        load_settings(cfg)
    with pytest.raises(ValidationError):
        KafkaSettings(namespace="bad name")


def test_secrets_are_masked() -> None:
    s = KafkaSettings(sasl_mechanism="PLAIN", sasl_username="u", sasl_password="hunter2")  # type: ignore[arg-type]
    assert "hunter2" not in s.model_dump_json()
    assert s.client_options()["sasl_plain_password"] == "hunter2"


def test_the_readme_configuration_example_is_valid() -> None:
    import re
    from pathlib import Path

    import yaml

    from deploy.settings import Settings

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = re.search(r"```yaml\n(kafka:.*?)```", readme, re.S)
    assert block is not None, "the README lost its configuration example"
    s = Settings.model_validate(yaml.safe_load(block.group(1)))
    assert s.admission.lease_s == 600 and s.router.policy == "kvgate"


def test_an_environment_variable_beats_the_file_even_at_its_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text("kafka:\n  namespace: fromfile\nrouter:\n  port: 9000\n")
    monkeypatch.setenv("KVGATE_KAFKA__NAMESPACE", "kvgate")  # the default value
    monkeypatch.setenv("KVGATE_ROUTER__PORT", "8000")  # the default value
    s = load_settings(cfg)
    assert s.kafka.namespace == "kvgate" and s.router.port == 8000


def test_printed_settings_mask_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    monkeypatch.setenv("KVGATE_ADMISSION__TENANTS", '{"sk-tenant-secret": {"name": "chat"}}')
    monkeypatch.setenv("KVGATE_ROUTER__GATEWAY_KEYS", '{"gw-secret-key": "envoy"}')
    monkeypatch.setenv("KVGATE_ROUTER__ADMIN_KEYS", '{"admin-secret-key": "ops"}')
    monkeypatch.setenv("KVGATE_KAFKA__SASL_PASSWORD", "hunter2")
    out = CliRunner().invoke(app, ["settings"]).output
    for secret in ("sk-tenant-secret", "gw-secret-key", "admin-secret-key", "hunter2"):
        assert secret not in out
    assert '"chat"' in out and '"envoy"' in out and "<masked " in out


def test_router_workers_get_their_own_admin_port_and_id() -> None:
    from deploy.routerproc import run_router, worker_settings
    from deploy.settings import Settings

    s = Settings.model_validate({"router": {"port": 9000, "admin_port": 9100, "workers": 3}})
    ws = [worker_settings(s, i).router for i in range(3)]
    assert [w.admin_port for w in ws] == [9100, 9101, 9102]
    assert [w.router_id for w in ws] == [None] * 3  # host:port:pid, distinct per process
    named = s.model_copy(update={"router": s.router.model_copy(update={"router_id": "r"})})
    assert worker_settings(named, 2).router.router_id == "r-w2"
    anywhere = Settings.model_validate({"router": {"admin_port": 0, "workers": 2}})
    assert worker_settings(anywhere, 1).router.admin_port == 0  # any free port, per worker
    with pytest.raises(SystemExit, match=r"fixed router\.port"):
        run_router(Settings.model_validate({"router": {"port": 0, "workers": 2}}))
    with pytest.raises(SystemExit, match=r"admission\.backend=redis"):
        run_router(Settings.model_validate({"router": {"port": 9000, "workers": 2}}))
    with pytest.raises(ValidationError):
        Settings.model_validate({"router": {"workers": 0}})


def test_router_event_loop_choice() -> None:
    import asyncio

    from router.serve import event_loop_factory

    assert event_loop_factory("asyncio") is None
    factory = event_loop_factory("uvloop")  # a dependency of kvgate on Linux
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, asyncio.AbstractEventLoop) and "uvloop" in type(loop).__module__
    finally:
        loop.close()
