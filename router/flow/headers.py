"""The headers kvgate reads, validated (printable ASCII, bounded) before anything of the body is
read or anything reserved: credentials, client labels, trace context, the priority a request may
lower itself to, the client address a gateway in front reports. Transport-free: the HTTP surfaces
and the endpoint picker read the same header mapping through these. Identifiers that guard state
are minted here (:func:`mint_id`); a client's ``X-Request-Id`` is only a recorded label."""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from router.flow.refusals import Refusal

__all__ = [
    "API_KEY_HEADER",
    "GATEWAY_KEY_HEADER",
    "PARENT_SESSION_HEADERS",
    "bearer_key",
    "client_label",
    "forwarded_peer",
    "match_key",
    "mint_id",
    "requested_priority",
    "session_label",
    "tenant_key",
    "trace_headers",
]

GATEWAY_KEY_HEADER = "X-Kvgate-Gateway-Key"
_PRINTABLE = re.compile(r"[\x21-\x7e]+")
_KEY_MAX = 512
MAX_SESSION_CHARS = 256  # as the body's session ids (router.parse.MAX_ID_CHARS)


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


def session_label(headers: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The session an agent client names in the first of ``names`` it sends (``x-session-id``,
    ``session-id``…), as kept and recorded: 1-256 printable ASCII characters without spaces.
    Raises :class:`Refusal` (400) for anything else; None when none is sent."""
    for name in names:
        if name in headers:
            return client_label(headers, name, MAX_SESSION_CHARS)
    return None


PARENT_SESSION_HEADERS = ("x-parent-session-id", "parent-session-id")


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


API_KEY_HEADER = "x-api-key"  # where Anthropic's clients send their key


def tenant_key(headers: Mapping[str, str]) -> str | None:
    """A tenant's key: ``Authorization: Bearer <key>`` (OpenAI's clients), else ``x-api-key``
    (Anthropic's: Claude Code and the Anthropic SDKs)."""
    if "Authorization" not in headers and API_KEY_HEADER in headers:
        return bearer_key(headers, API_KEY_HEADER)
    return bearer_key(headers)


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
