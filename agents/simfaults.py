"""What stands in front of the simulated engine's API: vLLM's ``--api-key``, the simulated
faults (every generation request failing or hanging, or a share of them), changeable at runtime
through ``POST /kvgate/fault``, and the retention hints it reads off a request (``agent_hint``:
the shape of vLLM's session-aware KV hints RFC)."""

from __future__ import annotations

import asyncio
import hmac
import random
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from agents.settings import EngineSettings
from streams.agentapis import API_PATHS
from streams.openai import error_body

__all__ = ["GENERATING", "MAX_RETENTION_S", "EngineGate", "retention_ttl"]

GENERATING = frozenset(API_PATHS.values())  # the paths a simulated fault applies to


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


MAX_RETENTION_S = 3600.0  # the longest hold an agent_hint may ask for (as the RFC bounds it)


def retention_ttl(extra: dict[str, Any] | None) -> float:
    """The seconds a request's ``agent_hint.cache_control.ttl`` asks its KV to be kept after it
    finishes (0: none, or a hint that is not one)."""
    hint = (extra or {}).get("agent_hint")
    control = hint.get("cache_control") if isinstance(hint, dict) else None
    ttl = control.get("ttl") if isinstance(control, dict) else None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl <= MAX_RETENTION_S:
        return 0.0
    return float(ttl)


class EngineGate:
    def __init__(self, settings: EngineSettings, rng: random.Random) -> None:
        self.settings, self._rng = settings, rng
        self.fault, self.fault_share = settings.fault, settings.fault_share

    @web.middleware
    async def auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """vLLM's --api-key: every /v1 path wants ``Authorization: Bearer <key>``."""
        key = self.settings.api_key
        if key is not None and request.path.startswith("/v1"):
            given = request.headers.get("Authorization", "")
            want = f"Bearer {key.get_secret_value()}"
            if not hmac.compare_digest(given.encode(), want.encode()):
                return _json({"error": "Unauthorized"}, 401)
        return await handler(request)

    @web.middleware
    async def faulty(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The configured fault, on generation requests only: metrics and health stay fine."""
        if (
            self.fault != "none"
            and request.path in GENERATING
            and self._rng.random() < self.fault_share
        ):
            if self.fault == "hang":
                await asyncio.Event().wait()  # until the client gives up
            return _json(error_body("engine fault (simulated)", "InternalServerError", 500), 500)
        return await handler(request)

    async def set_fault(self, request: web.Request) -> web.Response:
        """Change the simulated fault at runtime: {"fault": "none"|"error"|"hang", "share": x}."""
        try:
            body = orjson.loads(await request.read())
            fault, share = body["fault"], float(body.get("share", 1.0))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return _json(error_body(f"bad fault: {exc}"), 400)
        if fault not in ("none", "error", "hang") or not 0 <= share <= 1:
            return _json(error_body("fault is none, error or hang; share in [0, 1]"), 400)
        self.fault, self.fault_share = fault, share
        return _json({"fault": fault, "share": share})
