"""Redis settings for the shared reservation store (admission control)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr

__all__ = ["RedisSettings"]


class RedisSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = "redis://127.0.0.1:16379/0"
    password: SecretStr | None = None
    socket_timeout_s: float = Field(default=1.0, gt=0)
