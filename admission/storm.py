"""Retry-storm guard: a client that retries a refused request before its Retry-After is refused
again without touching the budget, and each early retry doubles its next Retry-After.

An attempt is identified by the ``Idempotency-Key`` header or, without one, by a fingerprint of
the tenant, the model and the prompt. After a refusal the guard remembers, per attempt, when a
retry is welcome; early retries count as strikes against the client (its tenant) within a
window. State lives in a :class:`StormStore`: in process for one router, in Redis for several.

A client that answers a refusal with *new* requests (a new key or prompt each time) is a storm
too: a refusal also sets the client's own Retry-After, and once a client has sent more than
``client_burst`` new requests within the window while it runs (a tenant has many users; a few
keep coming), the next ones are refused with ``retry_storm`` and the time left, without reaching
admission. The client is the tenant of an
API key, or an anonymous client's network address — anonymous clients are not one identity;
``retry_guard_new_requests`` says whose new requests count (anonymous clients by default).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from admission.core import Rejection, RejectReason
from admission.exceptions import AdmissionError

__all__ = ["InProcessStormStore", "RedisStormStore", "StormGuard", "StormStore"]


class StormStore(Protocol):
    async def not_before(self, attempt: str) -> float | None: ...
    async def not_before_many(self, attempts: Sequence[str]) -> list[float | None]: ...
    def keys(self, attempts: Sequence[str]) -> list[str] | None: ...
    async def set_not_before(self, attempt: str, at: float, ttl_s: float) -> None: ...
    async def strike(self, client: str, window_s: float) -> int: ...


@dataclass(slots=True)
class InProcessStormStore:
    clock: Callable[[], float] = time.time  # the simulator passes its virtual clock
    _attempts: dict[str, tuple[float, float]] = field(default_factory=dict)  # at, expires
    _strikes: dict[str, list[float]] = field(default_factory=dict)

    async def not_before(self, attempt: str) -> float | None:
        v = self._attempts.get(attempt)
        if v is None or v[1] < self.clock():
            self._attempts.pop(attempt, None)
            return None
        return v[0]

    async def not_before_many(self, attempts: Sequence[str]) -> list[float | None]:
        return [await self.not_before(a) for a in attempts]

    def keys(self, attempts: Sequence[str]) -> list[str] | None:
        """None: not in Redis (a reservation script cannot read them)."""
        return None

    async def set_not_before(self, attempt: str, at: float, ttl_s: float) -> None:
        if len(self._attempts) > 100_000:  # bounded: drop the expired ones
            now = self.clock()
            self._attempts = {k: v for k, v in self._attempts.items() if v[1] >= now}
        self._attempts[attempt] = (at, self.clock() + ttl_s)

    async def strike(self, client: str, window_s: float) -> int:
        now = self.clock()
        hits = [t for t in self._strikes.get(client, []) if now - t <= window_s]
        hits.append(now)
        self._strikes[client] = hits
        return len(hits)


class RedisStormStore:
    def __init__(self, client: Redis, prefix: str) -> None:
        self.r = client
        self.prefix = prefix

    async def not_before(self, attempt: str) -> float | None:
        try:
            v = await self.r.get(f"{self.prefix}:retry:{attempt}")
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"storm store unavailable: {exc}") from exc
        return None if v is None else float(v)

    def keys(self, attempts: Sequence[str]) -> list[str]:
        """The Redis keys holding the attempts' not-before times (a Lua script of the
        reservation store reads them in the same round trip as it reserves)."""
        return [f"{self.prefix}:retry:{a}" for a in attempts]

    async def not_before_many(self, attempts: Sequence[str]) -> list[float | None]:
        """:meth:`not_before` of each attempt, in one round trip."""
        try:
            vs = await self.r.mget(self.keys(attempts))
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"storm store unavailable: {exc}") from exc
        return [None if v is None else float(v) for v in vs]

    async def set_not_before(self, attempt: str, at: float, ttl_s: float) -> None:
        try:
            await self.r.set(
                f"{self.prefix}:retry:{attempt}", repr(at), px=max(1, int(ttl_s * 1000))
            )
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"storm store unavailable: {exc}") from exc

    async def strike(self, client: str, window_s: float) -> int:
        key = f"{self.prefix}:strikes:{client}"
        try:
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.incr(key)
                pipe.expire(key, max(1, int(window_s)), nx=True)
                count, _ = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"storm store unavailable: {exc}") from exc
        return int(count)


@dataclass(slots=True)
class StormGuard:
    store: StormStore
    window_s: float = 60.0
    max_retry_after_s: float = 300.0
    client_burst: int = 20  # new requests a client may send during its Retry-After

    @staticmethod
    def attempts(client: str, attempt: str, new_requests: bool) -> list[str]:
        """What :meth:`check_request` looks up: the attempt and, when ``new_requests``, the
        client's own Retry-After."""
        return [attempt, "client|" + client] if new_requests else [attempt]

    async def check_request(
        self, client: str, attempt: str, now: float, new_requests: bool
    ) -> Rejection | None:
        """:meth:`check` and, when ``new_requests``, :meth:`check_client`, with one read of
        the store for both (most requests are neither)."""
        ats = await self.store.not_before_many(self.attempts(client, attempt, new_requests))
        if ats[0] is not None and now < ats[0]:
            return await self.check(client, attempt, now, ats[0])
        if new_requests and ats[1] is not None and now < ats[1]:
            return await self.check_client(client, now, ats[1])
        return None

    async def check(
        self, client: str, attempt: str, now: float, at: float | None = None
    ) -> Rejection | None:
        """A refusal if this attempt comes back before it was told to (``at``: when it was
        told, already read)."""
        if at is None:
            at = await self.store.not_before(attempt)
        if at is None or now >= at:
            return None
        strikes = await self.store.strike(client, self.window_s)
        wait = min(self.max_retry_after_s, (at - now) * 2 ** min(strikes, 8))
        await self.store.set_not_before(attempt, now + wait, wait * 2)
        return Rejection(
            RejectReason.RETRY_STORM,
            True,
            wait,
            f"retried {at - now:.1f} s before Retry-After ({strikes} early retries "
            f"in {self.window_s:.0f} s): back off",
        )

    async def refused(
        self, attempt: str, rejection: Rejection, now: float, client: str | None = None
    ) -> None:
        """Remember when a retry of a refused attempt — and new requests of its client — are
        welcome."""
        if rejection.retriable and rejection.retry_after_s:
            ttl = 2 * rejection.retry_after_s + self.window_s
            await self.store.set_not_before(attempt, now + rejection.retry_after_s, ttl)
            if client is not None and rejection.reason != RejectReason.RETRY_STORM:
                key = "client|" + client
                at = await self.store.not_before(key)
                if at is None or at < now + rejection.retry_after_s:
                    await self.store.set_not_before(key, now + rejection.retry_after_s, ttl)

    async def check_client(
        self, client: str, now: float, at: float | None = None
    ) -> Rejection | None:
        """A refusal if ``client`` keeps sending new requests during its Retry-After (more than
        ``client_burst`` of them within the window)."""
        if at is None:
            at = await self.store.not_before("client|" + client)
        if at is None or now >= at:
            return None
        strikes = await self.store.strike("new|" + client, self.window_s)
        if strikes <= self.client_burst:
            return None
        return Rejection(
            RejectReason.RETRY_STORM,
            True,
            at - now,
            f"{strikes} new requests while told to retry after {at - now:.1f} s: back off",
        )
