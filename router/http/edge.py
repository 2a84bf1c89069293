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
import logging
import re
from collections.abc import Awaitable, Callable, Mapping

import orjson
from aiohttp import web

from router.flow.refusals import Refusal
from streams.openai import error_body

__all__ = ["error_middleware", "json_response", "path_guard", "read_body", "refusal_response"]

log = logging.getLogger(__name__)


def refusal_response(r: Refusal) -> web.Response:
    """``r`` as the HTTP response every surface answers it with."""
    return web.Response(
        body=r.body(), status=r.status, content_type="application/json", headers=r.headers
    )


def json_response(
    data: object, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """``data`` as a JSON response (every JSON answer of the router's HTTP surfaces)."""
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
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
