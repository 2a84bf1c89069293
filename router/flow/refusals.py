"""One typed refusal for every surface: a request refused at the edge (bad header, credentials,
body bounds), by intake (bad JSON, unknown model), by admission or by routing (no fit, a missed
deadline). Its status, OpenAI-shaped body and headers are derived here, once; the HTTP surfaces
turn it into a response (router/http/edge.py) and the endpoint picker into an ext_proc
ImmediateResponse (router/epp.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from admission.core import Rejection, RejectReason
from streams.openai import error_body

__all__ = ["Refusal", "rejection_status"]

# refusal reasons (metrics, decision records) of the edge's own refusals, by status
_REASONS = {
    400: "bad_header",
    401: "unauthorized",
    403: "forbidden",
    408: "body_timeout",
    413: "body_too_large",
}
_STATUS = {
    RejectReason.UNAUTHORIZED: 401,
    RejectReason.TOO_LARGE: 413,
    RejectReason.NO_CAPACITY: 503,
    RejectReason.YELLOW_LOW_PRIORITY: 429,
    RejectReason.RED_WATERMARK: 429,
    RejectReason.RETRY_STORM: 429,
    RejectReason.QUEUE_FULL: 429,
    RejectReason.QUEUE_TIMEOUT: 429,
    RejectReason.NODES_UNHEALTHY: 503,
    RejectReason.STORE_UNAVAILABLE: 503,
    RejectReason.TENANT_QUOTA: 429,
    RejectReason.DEADLINE: 429,
    RejectReason.NO_FIT_NOW: 503,
    RejectReason.RATE_LIMITED: 429,
    RejectReason.SCALING: 503,
    RejectReason.PREEMPTED: 503,
}


def rejection_status(rej: Rejection) -> int:
    return _STATUS[rej.reason]


class Refusal(Exception):
    """A refused request: ``status``, an OpenAI-shaped error ``body``, ``headers``
    (Retry-After), and the ``reason`` metrics and records name it by."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
        reason: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.headers = dict(headers or {})
        self.reason = reason or _REASONS.get(status, type_)
        self.extra = dict(extra or {})  # kvgate's fields in the error object

    @classmethod
    def of(cls, rej: Rejection) -> Refusal:
        """Admission's or routing's typed rejection, as clients hear it: its status, whether
        and when to retry (``Retry-After`` in seconds, ``retry-after-ms``)."""
        extra: dict[str, Any] = {"kvgate_reason": str(rej.reason), "retriable": rej.retriable}
        headers = {}
        if rej.retry_after_s is not None:
            extra["retry_after_s"] = rej.retry_after_s
            headers["Retry-After"] = str(max(1, math.ceil(rej.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, math.ceil(rej.retry_after_s * 1000)))
        return cls(
            rejection_status(rej), rej.message, str(rej.reason), headers, str(rej.reason), extra
        )

    def body(self) -> bytes:
        out = error_body(self.message, self.type, self.status)
        out["error"].update(self.extra)
        return orjson.dumps(out)
