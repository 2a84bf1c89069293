"""Typed admission rejections → HTTP, in exactly one place."""

from __future__ import annotations

import math

import orjson
from aiohttp import web

from admission.core import Rejection, RejectReason
from streams.openai import error_body

__all__ = ["rejection_response", "rejection_status"]

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
}


def rejection_status(rej: Rejection) -> int:
    return _STATUS[rej.reason]


def rejection_response(rej: Rejection) -> web.Response:
    status = rejection_status(rej)
    body = error_body(rej.message, str(rej.reason), status)
    body["error"]["kvgate_reason"] = str(rej.reason)
    body["error"]["retriable"] = rej.retriable
    headers = {}
    if rej.retry_after_s is not None:
        body["error"]["retry_after_s"] = rej.retry_after_s
        headers["Retry-After"] = str(max(1, math.ceil(rej.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(rej.retry_after_s * 1000)))
    return web.Response(
        body=orjson.dumps(body), status=status, headers=headers, content_type="application/json"
    )
