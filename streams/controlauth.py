"""Signed control messages: who may drain nodes, change weights or ask engines to pre-warm.

Anyone who can write to ``kvgate.control`` could otherwise drain every node or publish weights no
router should apply. With ``kafka.control_keys`` set (key id -> secret, several for a rotation)
every producer of control messages — ``kvgate weights/drain/canary``, routers (pre-warm advice),
the autoscaler — signs with ``kafka.control_key_id`` (HMAC-SHA256 over the message's canonical
bytes, the key id included), and every consumer — routers, agents — applies only messages signed
with one of the keys. Per subject, a message is applied only if it is newer (``ts``) than the last
one applied: a captured message published again later changes nothing (the producers' clocks
must agree to within the time between two messages of a subject; ``kvgate`` commands stamp
past the subject's last message).

Without keys nothing is signed or checked (a local setup); routers and agents say so at start
and in ``/v1/kvgate/state``.
"""

from __future__ import annotations

import hashlib
import hmac

import orjson
from pydantic import SecretStr

from streams.schemas import ControlMessage

__all__ = ["ControlAuth"]


def _canonical(msg: ControlMessage, key_id: str) -> bytes:
    return orjson.dumps(
        {
            "schema_version": msg.schema_version,
            "subject": msg.subject,
            "kind": msg.kind,
            "ts": msg.ts,
            "payload": msg.payload,
            "key_id": key_id,
        },
        option=orjson.OPT_SORT_KEYS,
    )


class ControlAuth:
    """Signs (with ``key_id``) and verifies (against every key of ``keys``) control messages."""

    def __init__(self, keys: dict[str, SecretStr], key_id: str | None = None) -> None:
        self.keys = {k: v.get_secret_value().encode() for k, v in keys.items()}
        if key_id is not None and key_id not in self.keys:
            raise ValueError(f"control_key_id {key_id!r} is not one of control_keys")
        self.key_id = key_id if key_id is not None else next(iter(sorted(self.keys)), None)
        self._last: dict[str, float] = {}  # subject -> ts of the last message accepted

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def sign(self, msg: ControlMessage) -> ControlMessage:
        """``msg`` signed with this process's key (as it is, without keys)."""
        if self.key_id is None:
            return msg
        mac = hmac.new(self.keys[self.key_id], _canonical(msg, self.key_id), hashlib.sha256)
        return msg.model_copy(update={"key_id": self.key_id, "signature": mac.hexdigest()})

    def check(self, msg: ControlMessage) -> str | None:
        """Why ``msg`` must not be applied (``unsigned``, ``unknown_key``, ``bad_signature``,
        ``stale``: not newer than the last accepted of its subject), or None: apply it. Without
        keys every message applies."""
        if not self.keys:
            return None  # (anyone may write anything: there is nothing to check)
        if msg.signature is None or msg.key_id is None:
            return "unsigned"
        key = self.keys.get(msg.key_id)
        if key is None:
            return "unknown_key"
        want = hmac.new(key, _canonical(msg, msg.key_id), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, msg.signature):
            return "bad_signature"
        last = self._last.get(msg.subject)
        if last is not None and msg.ts <= last:
            return "stale"
        self._last[msg.subject] = msg.ts
        return None
