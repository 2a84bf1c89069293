"""kvgate's settings: one nested model per component, from ``KVGATE_*`` variables and a file.

``KVGATE_KAFKA__BOOTSTRAP_SERVERS=broker:9092`` sets ``kafka.bootstrap_servers``; a YAML file named
by ``KVGATE_CONFIG`` (or ``--config``) gives the same keys nested. Variables win over the file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from admission.settings import AdmissionSettings, RedisSettings
from agents.settings import AgentSettings, EngineSettings
from analytics.autoscale import AutoscaleSettings
from analytics.settings import ClickHouseSettings, SinkSettings
from router.settings import RouterSettings
from streams.settings import KafkaSettings, WorkerSettings

__all__ = ["Settings", "load_settings", "public_dump"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", env_nested_delimiter="__", frozen=True, extra="forbid"
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    clickhouse: ClickHouseSettings = Field(default_factory=ClickHouseSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    sink: SinkSettings = Field(default_factory=SinkSettings)
    autoscale: AutoscaleSettings = Field(default_factory=AutoscaleSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, file_secret_settings)


def _mask(key: str) -> str:
    return f"<masked {hashlib.sha256(key.encode()).hexdigest()[:8]}>"


def public_dump(s: Settings) -> dict[str, Any]:
    """The settings as JSON for people to read: secrets and API keys (tenant, gateway and admin
    keys are dictionary keys) masked, each as a short fingerprint."""
    out = s.model_dump(mode="json")
    out["admission"]["tenants"] = {_mask(k): v for k, v in out["admission"]["tenants"].items()}
    for name in ("gateway_keys", "admin_keys"):
        out["router"][name] = {_mask(k): v for k, v in out["router"][name].items()}
    return out


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def load_settings(config: Path | None = None, **overrides: Any) -> Settings:
    """File (``config`` or ``$KVGATE_CONFIG``) < environment < ``overrides``."""
    path = config or (
        Path(os.environ["KVGATE_CONFIG"]) if os.environ.get("KVGATE_CONFIG") else None
    )
    file_values: dict[str, Any] = {}
    if path is not None:
        file_values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(file_values, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
    # what the environment sets, even to a default value (it still beats the file)
    env_only = Settings().model_dump(exclude_unset=True)
    merged = _deep_merge(_deep_merge(file_values, env_only), overrides)
    return Settings(**merged)
