"""The router's HTTP edge: everything a request must pass before kvgate does any work for it.

* Header values kvgate reads are validated (printable ASCII, bounded); anything else is a 400
  before a byte of the body is read or anything is reserved.
* Callers are authenticated before the body is read: tenants by their API key, gateways by a
  gateway key of their own (``X-Kvgate-Gateway-Key``), operators by an admin key.
* Bodies are bounded in size (413, checked on ``Content-Length`` before reading) and in time
  (408).
* Every error leaves in the OpenAI error shape, 5xx included, and never carries internal
  addresses or exception text (:func:`error_middleware`).

Identifiers that guard state are minted here (:func:`mint_id`); a client's ``X-Request-Id`` is
only a recorded label.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from router.flow.refusals import Refusal
from streams.openai import error_body

__all__ = [
    "GATEWAY_KEY_HEADER",
    "Refusal",
    "bearer_key",
    "client_label",
    "error_middleware",
    "forwarded_peer",
    "match_key",
    "mint_id",
    "path_guard",
    "read_body",
    "refusal_response",
    "requested_priority",
    "trace_headers",
]

log = logging.getLogger(__name__)

GATEWAY_KEY_HEADER = "X-Kvgate-Gateway-Key"
_PRINTABLE = re.compile(r"[\x21-\x7e]+")
_KEY_MAX = 512


def refusal_response(r: Refusal) -> web.Response:
    """``r`` as the HTTP response every surface answers it with."""
    return web.Response(
        body=r.body(), status=r.status, content_type="application/json", headers=r.headers
    )


def json_error(
    status: int, message: str, type_: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(error_body(message, type_, status)),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def mint_id() -> str:
    """A request / reservation id: 128 random bits, never chosen by a client."""
    return secrets.token_hex(16)


def client_label(headers: Mapping[str, str], name: str, max_len: int) -> str | None:
    """A client-chosen identifier (``X-Request-Id``, ``Idempotency-Key``, …) as a label:
    printable ASCII without spaces, at most ``max_len`` characters; absent → None.
    Raises :class:`Refusal` (400) for anything else."""
    value = headers.get(name)
    if value is None:
        return None
    if not value or len(value) > max_len or not _PRINTABLE.fullmatch(value):
        raise Refusal(
            400, f"header {name} must be 1-{max_len} printable ASCII characters without spaces"
        )
    return value


def bearer_key(headers: Mapping[str, str], name: str = "Authorization") -> str | None:
    """The key of ``Authorization: Bearer <key>`` (or the whole value of another header);
    None when absent. Raises :class:`Refusal` (400) for a malformed value."""
    value = headers.get(name)
    if value is None:
        return None
    if name.lower() == "authorization":
        scheme, _, key = value.partition(" ")
        if scheme.lower() != "bearer":
            raise Refusal(401, "Authorization must be 'Bearer <key>'", "unauthorized")
        value = key.strip()
    if not value or len(value) > _KEY_MAX or not _PRINTABLE.fullmatch(value):
        raise Refusal(401, f"malformed credential in {name}", "unauthorized")
    return value


def match_key(keys: Mapping[str, Any], key: str | None) -> Any | None:
    """The value ``keys`` maps ``key`` to, compared in constant time over every known key."""
    if key is None:
        return None
    found = None
    given = key.encode()
    for known, value in keys.items():
        if hmac.compare_digest(known.encode(), given):
            found = value
    return found


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, at most ``max_bytes`` (413, refused on ``Content-Length`` before
    reading when it says more) and within ``timeout_s`` (408)."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise Refusal(413, f"request body of {length} bytes is over the limit of {max_bytes}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                chunk = await request.content.read(1 << 16)
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise Refusal(413, f"request body is over the limit of {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise Refusal(408, f"request body not received within {timeout_s:g} s") from None
    return b"".join(chunks)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# a path segment kvgate refuses: a dot segment, or one with a percent-encoded or backslash
# character (no path kvgate serves needs either)
_BAD_SEGMENT = re.compile(r"\.{1,2}|.*[%\\].*")


@web.middleware
async def path_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Requests whose path is not already in normal form are refused with a 400 before any
    route sees them: dot segments (``/v1/../x``, ``/v1/./x``), percent-encoded characters
    (``/v1/%2e%2e/x``), backslashes and empty segments (``/v1//x``). Every path kvgate
    serves is plain ASCII without them, so no client needs one, and a path that would be
    normalized differently by an engine cannot reach it."""
    raw = request.raw_path.partition("?")[0]
    segments = raw.split("/")[1:]
    if not raw.startswith("/") or any(
        (not seg and i < len(segments) - 1) or _BAD_SEGMENT.fullmatch(seg)
        for i, seg in enumerate(segments)
    ):
        raise Refusal(
            400,
            "the request path must be in normal form: no dot segments, empty segments, "
            "percent-encoded characters or backslashes",
            reason="bad_path",
        )
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refusals, aiohttp's own HTTP errors and anything unexpected → OpenAI-shaped JSON.
    Unexpected errors are logged here and answered with a 500 that names nothing internal."""
    try:
        return await handler(request)
    except Refusal as exc:
        resp = refusal_response(exc)
        if exc.status in (408, 413):
            resp.force_close()  # the rest of the body is not worth reading
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason if exc.status != 404 else f"no route for {request.path_qs[:200]!r}"
        return json_error(
            exc.status, message, "invalid_request_error" if exc.status < 500 else "server_error"
        )
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path[:200])
        return json_error(500, "internal error in the router", "internal_error")


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_TRACESTATE_MAX = 512


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """W3C trace context to forward to the engine: ``traceparent`` when well formed (version
    ``ff`` and all-zero ids are invalid), with its ``tracestate`` when that is printable ASCII of
    at most 512 characters; anything else is dropped, never forwarded."""
    parent = headers.get("traceparent", "").strip().lower()
    if not _TRACEPARENT.match(parent):
        return {}
    version, trace_id, span_id, _ = parent.split("-")
    if version == "ff" or set(trace_id) == {"0"} or set(span_id) == {"0"}:
        return {}
    out = {"traceparent": parent}
    state = headers.get("tracestate", "")
    if state and len(state) <= _TRACESTATE_MAX and state.isascii() and state.isprintable():
        out["tracestate"] = state
    return out


# the Gateway API Inference Extension's criticality names, and kvgate's own priority names
_CRITICALITY = {
    "critical": "high",
    "standard": "normal",
    "sheddable": "low",
    "high": "high",
    "normal": "normal",
    "low": "low",
}
_PRIORITY_ORDER = ("high", "normal", "low")


def forwarded_peer(headers: Mapping[str, str]) -> str | None:
    """The client address a gateway in front appended last to ``X-Forwarded-For`` (Envoy does,
    and only the gateway reaches the external processor), if it is an IP address."""
    last = headers.get("x-forwarded-for", "").rsplit(",", 1)[-1].strip()[:64]
    try:
        return str(ipaddress.ip_address(last))
    except ValueError:
        return None


def requested_priority(
    headers: Mapping[str, str], objectives: Mapping[str, str], granted: str
) -> str:
    """The priority a request runs at: its tenant's (``granted``), or a lower one it asks for —
    by InferenceObjective name (``x-gateway-inference-objective``, mapped by ``objectives``) or
    by criticality (``x-gateway-criticality``: Critical / Standard / Sheddable, or kvgate's
    high / normal / low). A header never raises a request above its credential."""
    asked: str | None = None
    objective = headers.get("x-gateway-inference-objective", "").strip()
    if objective:
        asked = objectives.get(objective[:253])
    if asked is None:
        asked = _CRITICALITY.get(headers.get("x-gateway-criticality", "").strip().lower())
    if asked is None or _PRIORITY_ORDER.index(asked) <= _PRIORITY_ORDER.index(granted):
        return granted
    return asked
