"""The Redis reservation store: several routers share one budget.

Keys (``<prefix>`` is per namespace): ``<prefix>:held:<pool>`` hash {blocks, slots};
``<prefix>:resv`` hash id → "pool|blocks|slots|expires"; ``<prefix>:exp`` sorted set of ids by
lease expiry; ``<prefix>:drain:<pool>:<bucket>`` blocks released per ``bucket_s`` interval.
Check-and-reserve and release are Lua scripts, so they are atomic across routers. Redis errors
surface as :class:`AdmissionError`.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import RedisError

from admission.exceptions import AdmissionError
from admission.reservations import Reservation

__all__ = ["RedisReservations"]

_RESERVE = """
local held = KEYS[1]; local resv = KEYS[2]; local exp = KEYS[3]
local rid = ARGV[1]; local pool = ARGV[2]; local blocks = tonumber(ARGV[3])
local limit = tonumber(ARGV[4]); local expires = ARGV[5]; local slot_limit = tonumber(ARGV[6])
local existing = redis.call('HGET', resv, rid)
if existing then return existing end
local cur = tonumber(redis.call('HGET', held, 'blocks') or '0')
if cur + blocks > limit then return false end
if slot_limit >= 0 and tonumber(redis.call('HGET', held, 'slots') or '0') + 1 > slot_limit then
  return false
end
redis.call('HINCRBY', held, 'blocks', blocks)
redis.call('HINCRBY', held, 'slots', 1)
local value = pool .. '|' .. blocks .. '|1|' .. expires
redis.call('HSET', resv, rid, value)
redis.call('ZADD', exp, expires, rid)
return value
"""

_RELEASE = """
local resv = KEYS[1]; local exp = KEYS[2]; local prefix = ARGV[2]
local rid = ARGV[1]; local bucket = ARGV[3]; local ttl = ARGV[4]
local value = redis.call('HGET', resv, rid)
if not value then return false end
local pool, blocks, slots = string.match(value, '([^|]*)|([^|]*)|([^|]*)|')
redis.call('HINCRBY', prefix .. ':held:' .. pool, 'blocks', -tonumber(blocks))
redis.call('HINCRBY', prefix .. ':held:' .. pool, 'slots', -tonumber(slots))
redis.call('HDEL', resv, rid)
redis.call('ZREM', exp, rid)
local drain = prefix .. ':drain:' .. pool .. ':' .. bucket
redis.call('INCRBY', drain, blocks)
redis.call('EXPIRE', drain, ttl)
return value
"""


def _parse(rid: str, value: bytes | str) -> Reservation:
    text = value.decode() if isinstance(value, bytes) else value
    pool, blocks, slots, expires = text.split("|")
    return Reservation(rid, pool, int(blocks), int(slots), float(expires))


class RedisReservations:
    def __init__(
        self, client: Redis, prefix: str, drain_window_s: float = 30.0, bucket_s: float = 5.0
    ) -> None:
        self.r = client
        self.prefix = prefix
        self.drain_window_s = drain_window_s
        self.bucket_s = bucket_s
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(_RELEASE)

    async def try_reserve(
        self,
        rid: str,
        pool: str,
        kv_blocks: int,
        limit_blocks: int,
        now: float,
        lease_s: float,
        limit_slots: int | None = None,
    ) -> Reservation | None:
        p = self.prefix
        slots = -1 if limit_slots is None else limit_slots
        try:
            value = await self._reserve(
                keys=[f"{p}:held:{pool}", f"{p}:resv", f"{p}:exp"],
                args=[rid, pool, kv_blocks, limit_blocks, repr(now + lease_s), slots],
            )
        except RedisError as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        return None if value is None else _parse(rid, value)

    async def release(self, rid: str, now: float) -> Reservation | None:
        try:
            value = await self._release(
                keys=[f"{self.prefix}:resv", f"{self.prefix}:exp"],
                args=[
                    rid,
                    self.prefix,
                    int(now // self.bucket_s),
                    int(self.drain_window_s + 2 * self.bucket_s),
                ],
            )
        except RedisError as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        return None if value is None else _parse(rid, value)

    async def expire(self, now: float) -> list[Reservation]:
        try:
            due = await self.r.zrangebyscore(f"{self.prefix}:exp", "-inf", now)
        except RedisError as exc:
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
        except RedisError as exc:
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
        except RedisError as exc:
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
        except RedisError as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
