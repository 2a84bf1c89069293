"""The router's HTTP edge: everything a request must pass before kvgate does any work for it.

* Header values kvgate reads are validated (printable ASCII, bounded); anything else is a 400
  before a byte of the body is read or anything is reserved.
* Callers are authenticated before the body is read (each route's screen, run by the listener
  once the headers are in: router/http/app.py): tenants by their API key, gateways by a gateway
  key of their own (``X-Kvgate-Gateway-Key``), operators by an admin key.
* Paths not in normal form are a 400 (:func:`path_guard`), before any route is looked up.
* Bodies are bounded in size (413, refused on ``Content-Length`` before reading) and in time
  (408) by the listener (router/wire/server.py, ``router.max_body_bytes`` and
  ``router.body_timeout_s``).
* Every error leaves in the OpenAI error shape, 5xx included, and never carries internal
  addresses or exception text.

Identifiers that guard state are minted in the flow (``mint_id``); a client's ``X-Request-Id``
is only a recorded label.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import orjson

from router.flow.refusals import Refusal
from router.wire.server import Refused, Reply

__all__ = ["json_answer", "path_guard", "refused", "send_refusal"]

# a path segment kvgate refuses: a dot segment, or one with a percent-encoded or backslash
# character (no path kvgate serves needs either)
_BAD_SEGMENT = re.compile(r"\.{1,2}|.*[%\\].*")


def send_refusal(reply: Reply, r: Refusal) -> None:
    """``r`` as the HTTP answer every surface gives it (after a 408 or 413 the connection
    closes: the rest of the body is not worth reading)."""
    reply.send(r.status, r.body(), headers=r.headers.items(), close=r.status in (408, 413))


def refused(r: Refusal) -> Refused:
    """``r`` as the listener's answer to a request refused on its headers."""
    return Refused(r.status, r.body(), r.headers.items())


def json_answer(
    reply: Reply, data: object, status: int = 200, headers: Mapping[str, str] | None = None
) -> None:
    """``data`` as a JSON answer (every JSON answer of the router's HTTP surfaces)."""
    reply.send(status, orjson.dumps(data), headers=(headers or {}).items())


def path_guard(raw: str) -> None:
    """Requests whose path is not already in normal form are refused with a 400 before any
    route sees them: dot segments (``/v1/../x``, ``/v1/./x``), percent-encoded characters
    (``/v1/%2e%2e/x``), backslashes and empty segments (``/v1//x``). Every path kvgate
    serves is plain ASCII without them, so no client needs one, and a path that would be
    normalized differently by an engine cannot reach it."""
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
