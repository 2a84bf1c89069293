"""The Redis reservation store: several routers share one budget.

Keys (``<prefix>`` is per namespace): ``<prefix>:held:<pool>`` hash {blocks, slots};
``<prefix>:tenants:<pool>`` hash {"<tenant>|blocks", "<tenant>|slots"};
``<prefix>:resv`` hash id → "pool|blocks|slots|expires|tenant" (values written before tenants
were tracked have no tenant field); ``<prefix>:exp`` sorted set of ids by
lease expiry; ``<prefix>:drain:<pool>:<bucket>`` blocks released per ``bucket_s`` interval;
``<prefix>:generation`` set by the reconciler once the store matches the ledger (missing: Redis
lost its data, and nothing is admitted until the reconciler has restored the reservations);
``<prefix>:reconciler`` which router reconciles (a short lease).
Check-and-reserve, release and lease renewal are Lua scripts, so they are atomic across routers.
Redis errors surface as :class:`AdmissionError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError

from admission.exceptions import AdmissionError, StoreReset
from admission.redis_batch import ScriptBatcher
from admission.reservations import GUARDED, TENANT_LIMIT, Reservation, ReserveAsk
from admission.resp import ScriptLink

__all__ = ["RedisReservations"]

# "pool|blocks|slots|expires|tenant" (no tenant field in values written before tenants were kept)
_FIELDS = "local FIELDS = '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|?(.*)$'\n"

# unless a retry-guard key (KEYS[6..]) holds a time after ARGV[10]; a reservation answers
# its value with the pool's held blocks and slots once it is in
_RESERVE = """
local now = tonumber(ARGV[10])
for i = 6, #KEYS do
  local at = redis.call('GET', KEYS[i])
  if at and tonumber(at) > now then return 'GUARDED' end
end
local held = KEYS[1]; local resv = KEYS[2]; local exp = KEYS[3]
if redis.call('EXISTS', KEYS[4]) == 0 then return {err = 'KVGATE_STORE_RESET'} end
local rid = ARGV[1]; local pool = ARGV[2]; local blocks = tonumber(ARGV[3])
local limit = tonumber(ARGV[4]); local expires = ARGV[5]; local slot_limit = tonumber(ARGV[6])
local tenant = ARGV[7]; local t_blocks = tonumber(ARGV[8]); local t_slots = tonumber(ARGV[9])
local tenants = KEYS[5]
if redis.call('HEXISTS', resv, rid) == 1 then return false end
if t_blocks >= 0 and
   tonumber(redis.call('HGET', tenants, tenant .. '|blocks') or '0') + blocks > t_blocks then
  return 'TENANT'
end
if t_slots >= 0 and
   tonumber(redis.call('HGET', tenants, tenant .. '|slots') or '0') + 1 > t_slots then
  return 'TENANT'
end
local cur = tonumber(redis.call('HGET', held, 'blocks') or '0')
if cur + blocks > limit then return false end
if slot_limit >= 0 and tonumber(redis.call('HGET', held, 'slots') or '0') + 1 > slot_limit then
  return false
end
redis.call('HINCRBY', held, 'blocks', blocks)
redis.call('HINCRBY', held, 'slots', 1)
redis.call('HINCRBY', tenants, tenant .. '|blocks', blocks)
redis.call('HINCRBY', tenants, tenant .. '|slots', 1)
local value = pool .. '|' .. blocks .. '|1|' .. expires .. '|' .. tenant
redis.call('HSET', resv, rid, value)
redis.call('ZADD', exp, expires, rid)
return {value, redis.call('HGET', held, 'blocks'), redis.call('HGET', held, 'slots')}
"""

_RESTORE = """
local held = KEYS[1]; local resv = KEYS[2]; local exp = KEYS[3]
local rid = ARGV[1]; local value = ARGV[2]; local blocks = tonumber(ARGV[3])
local slots = tonumber(ARGV[4]); local expires = ARGV[5]; local tenant = ARGV[6]
if redis.call('HEXISTS', resv, rid) == 1 then return 0 end
redis.call('HINCRBY', held, 'blocks', blocks)
redis.call('HINCRBY', held, 'slots', slots)
redis.call('HINCRBY', KEYS[4], tenant .. '|blocks', blocks)
redis.call('HINCRBY', KEYS[4], tenant .. '|slots', slots)
redis.call('HSET', resv, rid, value)
redis.call('ZADD', exp, expires, rid)
return 1
"""

_RENEW = (
    _FIELDS
    + """
local resv = KEYS[1]; local exp = KEYS[2]; local rid = ARGV[1]; local expires = ARGV[2]
local value = redis.call('HGET', resv, rid)
if not value then return false end
local pool, blocks, slots, _, tenant = string.match(value, FIELDS)
value = pool .. '|' .. blocks .. '|' .. slots .. '|' .. expires .. '|' .. tenant
redis.call('HSET', resv, rid, value)
redis.call('ZADD', exp, expires, rid)
return value
"""
)

_LEAD = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] or (not cur and redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# a router is here: its newest time in a sorted set; those not seen within the window leave it
_PRESENT = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return redis.call('ZCARD', KEYS[1])
"""

_RELEASE = (
    _FIELDS
    + """
local resv = KEYS[1]; local exp = KEYS[2]; local prefix = ARGV[2]
local rid = ARGV[1]; local bucket = ARGV[3]; local ttl = ARGV[4]
local value = redis.call('HGET', resv, rid)
if not value then return false end
local pool, blocks, slots, _, tenant = string.match(value, FIELDS)
redis.call('HINCRBY', prefix .. ':held:' .. pool, 'blocks', -tonumber(blocks))
redis.call('HINCRBY', prefix .. ':held:' .. pool, 'slots', -tonumber(slots))
local tenants = prefix .. ':tenants:' .. pool
if redis.call('HINCRBY', tenants, tenant .. '|blocks', -tonumber(blocks)) <= 0 then
  redis.call('HDEL', tenants, tenant .. '|blocks')
end
if redis.call('HINCRBY', tenants, tenant .. '|slots', -tonumber(slots)) <= 0 then
  redis.call('HDEL', tenants, tenant .. '|slots')
end
redis.call('HDEL', resv, rid)
redis.call('ZREM', exp, rid)
local drain = prefix .. ':drain:' .. pool .. ':' .. bucket
redis.call('INCRBY', drain, blocks)
redis.call('EXPIRE', drain, ttl)
return value
"""
)


def _parse(rid: str, value: bytes | str) -> Reservation:
    text = value.decode() if isinstance(value, bytes) else value
    pool, blocks, slots, expires, *tenant = text.split("|", 4)
    return Reservation(rid, pool, int(blocks), int(slots), float(expires), "".join(tenant))


class RedisReservations:
    def __init__(
        self,
        client: Redis,
        prefix: str,
        drain_window_s: float = 30.0,
        bucket_s: float = 5.0,
        release_linger_s: float = 0.0,
    ) -> None:
        self.r = client
        # a release waits this long for a reservation to share its round trip with
        self.release_linger_s = release_linger_s
        self.prefix = prefix
        self.drain_window_s = drain_window_s
        self.bucket_s = bucket_s
        self._reserve = client.register_script(_RESERVE)
        # reservations and releases of one loop turn, in one round trip: on a connection of
        # their own (admission/resp.py), or through redis-py where that cannot serve
        self.batch: ScriptLink | ScriptBatcher = ScriptLink.of(client) or ScriptBatcher(client)
        self._release = client.register_script(_RELEASE)
        self._restore = client.register_script(_RESTORE)
        self._lead = client.register_script(_LEAD)
        self._present = client.register_script(_PRESENT)
        self._renew = client.register_script(_RENEW)

    async def _run(
        self, script: Any, keys: list[str], args: list[str | int], linger_s: float = 0.0
    ) -> Any:
        try:
            return await self.batch.run(script, keys, args, linger_s)
        except (RedisError, OSError) as exc:
            if "KVGATE_STORE_RESET" in str(exc):
                raise StoreReset(
                    "the reservation store lost its data; waiting for the reconciler to rebuild it"
                ) from exc
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc

    async def try_reserve(
        self, ask: ReserveAsk, now: float
    ) -> Reservation | Literal["tenant"] | None:
        r = await self.reserve_unguarded(ask, now)
        if isinstance(r, tuple):
            return r[0]
        return TENANT_LIMIT if r == TENANT_LIMIT else None  # no guard keys: never guarded

    async def reserve_unguarded(
        self, ask: ReserveAsk, now: float, guard: Sequence[str] = ()
    ) -> tuple[Reservation, int, int] | Literal["tenant", "guarded"] | None:
        """:meth:`try_reserve`, unless one of the retry guard's ``guard`` keys (full Redis
        keys: :meth:`admission.storm.RedisStormStore.keys`) says not before a time after
        ``now``; with the pool's held blocks and slots once it is in. One round trip."""
        p, pool = self.prefix, ask.pool
        keys = [
            f"{p}:held:{pool}",
            f"{p}:resv",
            f"{p}:exp",
            f"{p}:generation",
            f"{p}:tenants:{pool}",
            *guard,
        ]
        args: list[str | int] = [
            ask.rid,
            pool,
            ask.kv_blocks,
            ask.limit_blocks,
            repr(now + ask.lease_s),
            -1 if ask.limit_slots is None else ask.limit_slots,
            ask.tenant,
            -1 if ask.tenant_limit_blocks is None else ask.tenant_limit_blocks,
            -1 if ask.tenant_limit_slots is None else ask.tenant_limit_slots,
            repr(now),
        ]
        out = await self._run(self._reserve, keys, args)
        if out in (b"GUARDED", "GUARDED"):
            return GUARDED
        if out in (b"TENANT", "TENANT"):
            return TENANT_LIMIT
        if out is None:
            return None
        value, blocks, slots = out
        return _parse(ask.rid, value), int(blocks), int(slots)

    async def tenant_usage(self, pool: str) -> dict[str, tuple[int, int]]:
        try:
            raw = await self.r.hgetall(f"{self.prefix}:tenants:{pool}")
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        out: dict[str, list[int]] = {}
        for k, v in raw.items():
            field = k.decode() if isinstance(k, bytes) else str(k)
            name, _, what = field.rpartition("|")
            out.setdefault(name, [0, 0])[0 if what == "blocks" else 1] = int(v)
        return {t: (b, s) for t, (b, s) in out.items()}

    async def release(self, rid: str, now: float) -> Reservation | None:
        value = await self._run(
            self._release,
            [f"{self.prefix}:resv", f"{self.prefix}:exp"],
            [
                rid,
                self.prefix,
                int(now // self.bucket_s),
                int(self.drain_window_s + 2 * self.bucket_s),
            ],
            self.release_linger_s,
        )
        return None if value is None else _parse(rid, value)

    async def aclose(self) -> None:
        """Send the calls gathered and close the scripts' connection (the client is the
        caller's to close)."""
        await self.batch.aclose()

    async def renew(self, rid: str, expires_at: float) -> Reservation | None:
        try:
            value = await self._renew(
                keys=[f"{self.prefix}:resv", f"{self.prefix}:exp"], args=[rid, repr(expires_at)]
            )
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        return None if value is None else _parse(rid, value)

    async def expire(self, now: float) -> list[Reservation]:
        try:
            due = await self.r.zrangebyscore(f"{self.prefix}:exp", "-inf", now)
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        out = []
        for member in due:
            rid = member.decode() if isinstance(member, bytes) else str(member)
            r = await self.release(rid, now)
            if r is not None:  # another router may have expired it first
                out.append(r)
        return out

    async def held(self, pool: str) -> tuple[int, int]:
        try:
            blocks, slots = await self.r.hmget(f"{self.prefix}:held:{pool}", "blocks", "slots")
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        return int(blocks or 0), int(slots or 0)

    async def snapshot(self, pool: str, now: float) -> tuple[int, int, float]:
        """Held blocks, held slots and the drain rate in one round trip."""
        last = int(now // self.bucket_s)
        n = int(self.drain_window_s // self.bucket_s)
        buckets = [f"{self.prefix}:drain:{pool}:{b}" for b in range(last - n + 1, last + 1)]
        try:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.hmget(f"{self.prefix}:held:{pool}", "blocks", "slots")
                pipe.mget(buckets)
                (blocks, slots), drained = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        seen = [i for i, x in enumerate(drained) if x is not None]
        total = sum(int(drained[i]) for i in seen)
        # over the part of the window with releases seen (right after a start the window is
        # mostly empty, and averaging over all of it would make the drain look near zero)
        span = (n - seen[0]) * self.bucket_s if seen else n * self.bucket_s
        return int(blocks or 0), int(slots or 0), total / span

    async def drain_rate(self, pool: str, now: float) -> float:
        return (await self.snapshot(pool, now))[2]

    async def count(self) -> int:
        try:
            return int(await self.r.hlen(f"{self.prefix}:resv"))
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc

    async def entries(self) -> dict[str, Reservation]:
        try:
            raw = await self.r.hgetall(f"{self.prefix}:resv")
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        out = {}
        for k, v in raw.items():
            rid = k.decode() if isinstance(k, bytes) else str(k)
            out[rid] = _parse(rid, v)
        return out

    async def restore(self, r: Reservation) -> bool:
        p = self.prefix
        value = f"{r.pool}|{r.kv_blocks}|{r.slots}|{r.expires_at!r}|{r.tenant}"
        try:
            done = await self._restore(
                keys=[f"{p}:held:{r.pool}", f"{p}:resv", f"{p}:exp", f"{p}:tenants:{r.pool}"],
                args=[
                    r.reservation_id,
                    value,
                    r.kv_blocks,
                    r.slots,
                    repr(r.expires_at),
                    r.tenant,
                ],
            )
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        return bool(done)

    async def _text(self, key: str) -> str | None:
        try:
            value = await self.r.get(f"{self.prefix}:{key}")
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    async def generation(self) -> str | None:
        return await self._text("generation")

    async def mark_generation(self, generation: str) -> None:
        try:
            await self.r.set(f"{self.prefix}:generation", generation)
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc

    async def lead(self, who: str, ttl_s: float) -> bool:
        try:
            return bool(
                await self._lead(keys=[f"{self.prefix}:reconciler"], args=[who, int(ttl_s * 1000)])
            )
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc

    async def leader(self) -> str | None:
        return await self._text("reconciler")

    async def present(self, who: str, now: float, window_s: float) -> int:
        args: list[str | int] = [who, repr(now), repr(now - window_s), int(window_s * 1000)]
        try:
            return int(await self._present(keys=[f"{self.prefix}:routers"], args=args))
        except (RedisError, OSError) as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
