"""Per-tenant request and token rates: ``requests_per_minute`` and ``tokens_per_minute``,
enforced over a sliding window (``admission.rate_window_s``, a minute by default: a limit
holds over every window that long, scaled to it) and shared by every router through Redis.

A request is counted when admission takes it — one request and its prompt's tokens — and its
tokens are corrected once it ends (prompt and output, as served); a request refused after it
was counted (the budget, its queue) is given back. Over a limit, it is refused (429
``rate_limited``) with the time until the window has room for it as ``Retry-After``; a prompt
larger than the whole token limit never fits and says so. One log per tenant: request ids
with when they were taken, and their tokens.

While the shared store is away (admission/failover.py), each router counts in process against
its share of each limit.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from admission.core import Verdict
from admission.exceptions import AdmissionError
from admission.plan import AdmissionAsk, per_window, rate_refusal
from admission.settings import AdmissionSettings, Tenant

if TYPE_CHECKING:
    from admission.failover import FailoverReservations

__all__ = [
    "NEVER",
    "InProcessRates",
    "RateAsk",
    "RateStore",
    "RedisRates",
    "SharedRates",
    "TenantRates",
    "counted",
]

log = logging.getLogger(__name__)
NEVER = math.inf  # what ``take`` answers for a prompt larger than the whole token limit


def counted(tenant: Tenant) -> bool:
    """Whether the tenant has a rate to count against."""
    return tenant.requests_per_minute is not None or tenant.tokens_per_minute is not None


@dataclass(frozen=True, slots=True)
class RateAsk:
    """Count request ``rid`` of ``tenant`` with ``tokens`` against at most ``requests`` and
    ``tokens_limit`` within ``window_s`` (None: no such limit)."""

    tenant: str
    rid: str
    tokens: int
    requests: int | None
    tokens_limit: int | None
    window_s: float

    def scaled(self, share: float) -> RateAsk:
        """The same ask against ``share`` of each limit (at least one request's worth)."""

        def part(v: int | None) -> int | None:
            return None if v is None else max(1, math.floor(v * share))

        return RateAsk(
            self.tenant, self.rid, self.tokens, part(self.requests), part(self.tokens_limit),
            self.window_s,
        )  # fmt: skip


class RateStore(Protocol):
    async def take(self, ask: RateAsk, now: float) -> float:
        """0: counted; else the seconds until it would fit (:data:`NEVER`: it never will)."""
        ...

    async def settle(self, tenant: str, rid: str, tokens: int) -> None: ...
    async def give_back(self, tenant: str, rid: str) -> None: ...


def _wait(entries: list[tuple[float, int]], total: int, ask: RateAsk, now: float) -> float:
    """Seconds until ``ask`` fits among ``entries`` (taken at, tokens; oldest first, all
    within the window) holding ``total`` tokens."""
    wait, w = 0.0, ask.window_s
    if ask.requests is not None and len(entries) + 1 > ask.requests:
        wait = entries[len(entries) - ask.requests][0] + w - now
    if ask.tokens_limit is not None and total + ask.tokens > ask.tokens_limit:
        if ask.tokens > ask.tokens_limit:
            return NEVER
        need, freed = total + ask.tokens - ask.tokens_limit, 0
        for at, tokens in entries:
            freed += tokens
            if freed >= need:
                wait = max(wait, at + w - now)
                break
    return max(0.0, wait)


@dataclass(slots=True)
class _Log:
    order: deque[str] = field(default_factory=deque)
    entries: dict[str, tuple[float, int]] = field(default_factory=dict)
    total: int = 0


@dataclass(slots=True)
class InProcessRates:
    """The rates of one router (or of the simulator)."""

    _logs: dict[str, _Log] = field(default_factory=dict)

    def _expire(self, log: _Log, now: float, window_s: float) -> None:
        while log.order:
            rid = log.order[0]
            got = log.entries.get(rid)
            if got is not None and got[0] > now - window_s:
                break
            log.order.popleft()
            if got is not None:
                log.total -= log.entries.pop(rid)[1]

    async def take(self, ask: RateAsk, now: float) -> float:
        log = self._logs.setdefault(ask.tenant, _Log())
        self._expire(log, now, ask.window_s)
        if ask.rid in log.entries:
            return 0.0
        over_requests = ask.requests is not None and len(log.entries) + 1 > ask.requests
        over_tokens = ask.tokens_limit is not None and log.total + ask.tokens > ask.tokens_limit
        if over_requests or over_tokens:  # the log is read only then
            entries = [log.entries[r] for r in log.order if r in log.entries]
            wait = _wait(entries, log.total, ask, now)
            if wait > 0:
                return wait
        log.order.append(ask.rid)
        log.entries[ask.rid] = (now, ask.tokens)
        log.total += ask.tokens
        return 0.0

    async def settle(self, tenant: str, rid: str, tokens: int) -> None:
        log = self._logs.get(tenant)
        if log is not None and rid in log.entries:
            at, old = log.entries[rid]
            log.entries[rid] = (at, tokens)
            log.total += tokens - old

    async def give_back(self, tenant: str, rid: str) -> None:
        log = self._logs.get(tenant)
        if log is not None and rid in log.entries:
            log.total -= log.entries.pop(rid)[1]  # its place in ``order`` goes when it expires


_EXPIRE = """
local log, tok = KEYS[1], KEYS[2]
local now, w = tonumber(ARGV[1]), tonumber(ARGV[2])
local old = redis.call('ZRANGEBYSCORE', log, '-inf', now - w)
for _, m in ipairs(old) do
  redis.call('HINCRBY', tok, '_total', -tonumber(redis.call('HGET', tok, m) or '0'))
  redis.call('HDEL', tok, m)
end
if #old > 0 then redis.call('ZREMRANGEBYSCORE', log, '-inf', now - w) end
"""

# the log (a sorted set of request ids by when they were taken) and their tokens (a hash, with
# the sum in '_total'); answers '0' when counted, else the seconds to wait ('inf': never)
_TAKE = (
    _EXPIRE
    + """
local rid, tokens = ARGV[3], tonumber(ARGV[4])
local requests, limit = tonumber(ARGV[5]), tonumber(ARGV[6])
if redis.call('HEXISTS', tok, rid) == 1 then return '0' end
local count = redis.call('ZCARD', log)
local total = tonumber(redis.call('HGET', tok, '_total') or '0')
local wait = 0
if requests >= 0 and count + 1 > requests then
  local e = redis.call('ZRANGE', log, count - requests, count - requests, 'WITHSCORES')
  wait = tonumber(e[2]) + w - now
end
if limit >= 0 and total + tokens > limit then
  if tokens > limit then return 'inf' end
  local need, freed = total + tokens - limit, 0
  local entries = redis.call('ZRANGE', log, 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    freed = freed + tonumber(redis.call('HGET', tok, entries[i]) or '0')
    if freed >= need then
      wait = math.max(wait, tonumber(entries[i + 1]) + w - now)
      break
    end
  end
end
if wait > 0 then return tostring(wait) end
redis.call('ZADD', log, now, rid)
redis.call('HSET', tok, rid, tokens)
redis.call('HINCRBY', tok, '_total', tokens)
local ttl = math.ceil(w * 1000) + 1000
redis.call('PEXPIRE', log, ttl)
redis.call('PEXPIRE', tok, ttl)
return '0'
"""
)

_SETTLE = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], '_total', tonumber(ARGV[2]) - tonumber(old))
return 1
"""

_GIVE_BACK = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[2], '_total', -tonumber(old))
return 1
"""


class RedisRates:
    """Every router's rates in one Redis (Lua scripts: atomic across routers)."""

    def __init__(self, client: Redis, prefix: str) -> None:
        self.prefix = prefix
        self._take = client.register_script(_TAKE)
        self._settle = client.register_script(_SETTLE)
        self._give_back = client.register_script(_GIVE_BACK)

    def _keys(self, tenant: str) -> list[str]:
        return [f"{self.prefix}:rate:{tenant}:log", f"{self.prefix}:rate:{tenant}:tokens"]

    async def take(self, ask: RateAsk, now: float) -> float:
        args: list[str | int] = [
            repr(now), repr(ask.window_s), ask.rid, ask.tokens,
            -1 if ask.requests is None else ask.requests,
            -1 if ask.tokens_limit is None else ask.tokens_limit,
        ]  # fmt: skip
        try:
            out = await self._take(keys=self._keys(ask.tenant), args=args)
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"rate store unavailable: {exc}") from exc
        return float(out.decode() if isinstance(out, bytes) else out)

    async def settle(self, tenant: str, rid: str, tokens: int) -> None:
        try:
            await self._settle(keys=self._keys(tenant), args=[rid, tokens])
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"rate store unavailable: {exc}") from exc

    async def give_back(self, tenant: str, rid: str) -> None:
        try:
            await self._give_back(keys=self._keys(tenant), args=[rid])
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"rate store unavailable: {exc}") from exc


class SharedRates:
    """Redis's rates while the reservation store uses it; this router's own, against its
    share of each limit, while that store is away (or this call could not reach it)."""

    def __init__(self, shared: RateStore, reservations: FailoverReservations) -> None:
        self.shared = shared
        self.reservations = reservations
        self.local = InProcessRates()

    async def take(self, ask: RateAsk, now: float) -> float:
        if not self.reservations.degraded:
            try:
                return await self.shared.take(ask, now)
            except AdmissionError:
                pass
        return await self.local.take(ask.scaled(self.reservations.share), now)

    async def settle(self, tenant: str, rid: str, tokens: int) -> None:
        await self.local.settle(tenant, rid, tokens)
        if not self.reservations.degraded:
            try:
                await self.shared.settle(tenant, rid, tokens)
            except AdmissionError:
                pass

    async def give_back(self, tenant: str, rid: str) -> None:
        await self.local.give_back(tenant, rid)
        if not self.reservations.degraded:
            try:
                await self.shared.give_back(tenant, rid)
            except AdmissionError:
                pass


class TenantRates:
    """The admission gate's side: count a request against its tenant's rates, give it back,
    correct its tokens. A store that cannot answer counts nothing: rates protect, they never
    take the service down."""

    def __init__(self, store: RateStore, settings: AdmissionSettings) -> None:
        self.store = store
        self.settings = settings

    async def count(self, ask: AdmissionAsk, now: float) -> Verdict | None:
        """None: counted (or the store could not answer); else the refusal."""
        t, s = ask.tenant, self.settings
        rask = RateAsk(
            t.name,
            ask.request_id,
            ask.prompt_tokens,
            per_window(t.requests_per_minute, s),
            per_window(t.tokens_per_minute, s),
            s.rate_window_s,
        )
        try:
            wait = await self.store.take(rask, now)
        except AdmissionError as exc:
            log.warning("rates not counted for %s: %s", ask.request_id, exc)
            return None
        return rate_refusal(t, wait, s) if wait > 0 else None

    async def uncount(self, tenant: Tenant, request_id: str) -> None:
        with contextlib.suppress(AdmissionError):
            await self.store.give_back(tenant.name, request_id)

    async def used(self, tenant: Tenant, request_id: str, tokens: int) -> None:
        """A request ended having used ``tokens`` (prompt and output)."""
        if tenant.tokens_per_minute is not None:
            with contextlib.suppress(AdmissionError):
                await self.store.settle(tenant.name, request_id, tokens)
