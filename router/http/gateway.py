"""The gateway API: ``POST /v1/kvgate/route``, ``/release``, ``/renew``.

A gateway (Envoy, a Kubernetes gateway) asks where a request should go and forwards it itself:
the router admits and routes it like its own (router/flow/external.py), answers with the node
and its reservation, and holds the reservation until the gateway releases it, renews it, or
lets its lease run out (then the router ends it). Only callers with a gateway key
(``X-Kvgate-Gateway-Key``) may use it, and a gateway sees only its own reservations.
"""

from __future__ import annotations

import time
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from admission.exceptions import AdmissionError
from admission.gate import AdmissionGate
from router.flow.entry import Entry
from router.flow.external import ExternalRequests
from router.flow.flight import Flight, Flights
from router.flow.headers import GATEWAY_KEY_HEADER, bearer_key, match_key
from router.flow.intake import Head
from router.flow.refusals import Refusal
from router.http.edge import json_answer
from router.metrics import RouterMetrics
from router.settings import RouterSettings
from router.wire.server import Headers, Reply, Request

__all__ = ["GatewayApi", "GatewayRelease", "GatewayRenew"]


class GatewayRelease(BaseModel):
    """``POST /v1/kvgate/release``: a gateway is done with a request it had routed."""

    model_config = ConfigDict(extra="forbid")

    reservation_id: str = Field(min_length=1)
    status: Literal["ok", "error", "cancelled"] = "ok"
    output_tokens: int = Field(default=0, ge=0)
    ttft_s: float | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)
    prompt_tokens: int | None = Field(
        default=None, ge=0, description="the engine's usage.prompt_tokens (calibrates counts)"
    )


class GatewayRenew(BaseModel):
    """``POST /v1/kvgate/renew``: a gateway's request is still running; move its lease."""

    model_config = ConfigDict(extra="forbid")

    reservation_id: str = Field(min_length=1)


_B = TypeVar("_B", bound=BaseModel)


_SMALL = 64 << 10  # the largest release or renewal body


def _read_model(request: Request, model: type[_B]) -> _B:
    """A small JSON body (≤ 64 KiB) as ``model``; a 400 names the first invalid field."""
    raw = request.body
    if len(raw) > _SMALL:
        raise Refusal(413, f"request body is over the limit of {_SMALL} bytes")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise Refusal(400, f"{where}: {first['msg']}") from None


class GatewayApi:
    def __init__(
        self,
        settings: RouterSettings,
        metrics: RouterMetrics,
        entry: Entry,
        external: ExternalRequests,
        gate: AdmissionGate,
        flights: Flights,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.entry = entry
        self.external = external
        self.gate = gate
        self.flights = flights

    def screen(self, headers: Headers, _: str) -> str:
        """The gateway calling the gateway API, by its key (``X-Kvgate-Gateway-Key``)."""
        if not self.settings.gateway_keys:
            self.metrics.rejected("gateway_unauthorized")
            raise Refusal(
                403, "the gateway API is closed: no router.gateway_keys", "permission_error"
            )
        name = match_key(self.settings.gateway_keys, bearer_key(headers, GATEWAY_KEY_HEADER))
        if name is None:
            self.metrics.rejected("gateway_unauthorized")
            raise Refusal(401, f"a gateway key is required ({GATEWAY_KEY_HEADER})", "unauthorized")
        return str(name)

    def screen_route(self, headers: Headers, _: str) -> tuple[str, Head]:
        """The gateway, then the request's own headers (as a tenant's)."""
        return self.screen(headers, _), self.entry.reader.head(headers, time.time())

    async def route(self, request: Request, reply: Reply) -> None:
        """Admit and route like ``/v1/completions`` but do not forward: the gateway (e.g. Envoy)
        sends the request to the returned endpoint itself and calls ``/v1/kvgate/release``
        with the reservation id when it is done (else the reservation expires with its lease).
        The body is an OpenAI completion or chat request; the same refusals apply. Only callers
        with a gateway key may use it; the reservation is theirs alone to renew and release."""
        gateway, head = request.screened[1]
        taken = await self.entry.take(
            request.headers, request.read, None, request.peer, head, hold=False
        )
        routed = await self.external.route(gateway, taken)
        request_id, rreq, decision, node, p = routed
        held = self.gate.held.get(request_id)
        json_answer(
            reply,
            {
                "request_id": request_id,
                "reservation_id": request_id if held is not None else None,
                "lease_expires_at": held.expires_at if held is not None else None,
                "node_id": node.node_id,
                "endpoint": node.endpoint,
                "headers": node.engine_headers,  # to send with the request (a DP rank)
                "path": p.path,
                "model": p.model,
                # to set as the body's cache_salt (the tenant's, router.flow.salt; None: leave
                # the body's as it is): the engine's cache must be keyed as the router hashed it
                "cache_salt": p.cache_salt,
                "reason": decision.reason,
                "prompt_blocks": len(rreq.block_hashes),
                "kv_blocks_reserved": held.kv_blocks if held is not None else 0,
            },
        )

    async def release(self, request: Request, reply: Reply) -> None:
        """The gateway finished a routed request: release its reservation and record the
        outcome it reports (``status``, ``output_tokens``, ``ttft_s``, ``cached_tokens``)."""
        gateway = request.screened[1]
        body = _read_model(request, GatewayRelease)
        self._owned(gateway, body.reservation_id)  # a 404 unless this gateway routed it
        await self.external.finish(
            body.reservation_id,
            body.status,
            body.output_tokens,
            body.ttft_s,
            body.cached_tokens,
            body.prompt_tokens,
        )
        json_answer(reply, {"released": body.reservation_id})

    async def renew(self, request: Request, reply: Reply) -> None:
        """A gateway's routed request runs longer than its lease: renew it (call again before
        ``lease_expires_at``)."""
        gateway = request.screened[1]
        body = _read_model(request, GatewayRenew)
        rid = body.reservation_id
        owned = self._owned(gateway, rid)
        now = time.time()
        if rid in self.gate.held:
            try:
                await self.gate.renew([rid], now, force=True)
            except AdmissionError as exc:
                raise Refusal(503, str(exc), "ServiceUnavailableError") from None
        held = self.gate.held.get(rid)
        until = held.expires_at if held is not None else now + self.gate.settings.lease_s
        owned.until = until
        json_answer(reply, {"reservation_id": rid, "lease_expires_at": until})

    def _owned(self, gateway: str, rid: str) -> Flight:
        """The routed request ``rid`` if ``gateway`` routed it; a 404 otherwise (the same
        answer as for an unknown id: another gateway's reservations are not even visible)."""
        f = self.flights.owned(gateway, rid)
        if f is None:
            gone = "no such routed request (released already, its lease ran out, or not yours)"
            raise Refusal(404, gone, "NotFoundError")
        return f
