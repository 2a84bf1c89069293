"""The Redis reservation store: several routers share one budget.

Keys (``<prefix>`` is per namespace): ``<prefix>:held:<pool>`` hash {blocks, slots};
``<prefix>:resv`` hash id → "pool|blocks|slots|expires"; ``<prefix>:exp`` sorted set of ids by
lease expiry; ``<prefix>:drain:<pool>:<bucket>`` blocks released per ``bucket_s`` interval;
``<prefix>:generation`` set by the reconciler once the store matches the ledger (missing: Redis
lost its data, and nothing is admitted until the reconciler has restored the reservations);
``<prefix>:reconciler`` which router reconciles (a short lease).
Check-and-reserve, release and lease renewal are Lua scripts, so they are atomic across routers.
Redis errors surface as :class:`AdmissionError`.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import RedisError

from admission.exceptions import AdmissionError, StoreReset
from admission.reservations import Reservation

__all__ = ["RedisReservations"]

_RESERVE = """
local held = KEYS[1]; local resv = KEYS[2]; local exp = KEYS[3]
if redis.call('EXISTS', KEYS[4]) == 0 then return {err = 'KVGATE_STORE_RESET'} end
local rid = ARGV[1]; local pool = ARGV[2]; local blocks = tonumber(ARGV[3])
local limit = tonumber(ARGV[4]); local expires = ARGV[5]; local slot_limit = tonumber(ARGV[6])
if redis.call('HEXISTS', resv, rid) == 1 then return false end
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

_RESTORE = """
local held = KEYS[1]; local resv = KEYS[2]; local exp = KEYS[3]
local rid = ARGV[1]; local value = ARGV[2]; local blocks = tonumber(ARGV[3])
local slots = tonumber(ARGV[4]); local expires = ARGV[5]
if redis.call('HEXISTS', resv, rid) == 1 then return 0 end
redis.call('HINCRBY', held, 'blocks', blocks)
redis.call('HINCRBY', held, 'slots', slots)
redis.call('HSET', resv, rid, value)
redis.call('ZADD', exp, expires, rid)
return 1
"""

_RENEW = """
local resv = KEYS[1]; local exp = KEYS[2]; local rid = ARGV[1]; local expires = ARGV[2]
local value = redis.call('HGET', resv, rid)
if not value then return false end
local pool, blocks, slots = string.match(value, '([^|]*)|([^|]*)|([^|]*)|')
value = pool .. '|' .. blocks .. '|' .. slots .. '|' .. expires
redis.call('HSET', resv, rid, value)
redis.call('ZADD', exp, expires, rid)
return value
"""

_LEAD = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] or (not cur and redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
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
        self._restore = client.register_script(_RESTORE)
        self._lead = client.register_script(_LEAD)
        self._renew = client.register_script(_RENEW)

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
                keys=[f"{p}:held:{pool}", f"{p}:resv", f"{p}:exp", f"{p}:generation"],
                args=[rid, pool, kv_blocks, limit_blocks, repr(now + lease_s), slots],
            )
        except RedisError as exc:
            if "KVGATE_STORE_RESET" in str(exc):
                raise StoreReset(
                    "the reservation store lost its data; waiting for the reconciler to rebuild it"
                ) from exc
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

    async def renew(self, rid: str, expires_at: float) -> Reservation | None:
        try:
            value = await self._renew(
                keys=[f"{self.prefix}:resv", f"{self.prefix}:exp"], args=[rid, repr(expires_at)]
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

    async def entries(self) -> dict[str, Reservation]:
        try:
            raw = await self.r.hgetall(f"{self.prefix}:resv")
        except RedisError as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        out = {}
        for k, v in raw.items():
            rid = k.decode() if isinstance(k, bytes) else str(k)
            out[rid] = _parse(rid, v)
        return out

    async def restore(self, r: Reservation) -> bool:
        p = self.prefix
        value = f"{r.pool}|{r.kv_blocks}|{r.slots}|{r.expires_at!r}"
        try:
            done = await self._restore(
                keys=[f"{p}:held:{r.pool}", f"{p}:resv", f"{p}:exp"],
                args=[r.reservation_id, value, r.kv_blocks, r.slots, repr(r.expires_at)],
            )
        except RedisError as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        return bool(done)

    async def generation(self) -> str | None:
        try:
            value = await self.r.get(f"{self.prefix}:generation")
        except RedisError as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    async def mark_generation(self, generation: str) -> None:
        try:
            await self.r.set(f"{self.prefix}:generation", generation)
        except RedisError as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc

    async def lead(self, who: str, ttl_s: float) -> bool:
        try:
            return bool(
                await self._lead(keys=[f"{self.prefix}:reconciler"], args=[who, int(ttl_s * 1000)])
            )
        except RedisError as exc:
            raise AdmissionError(f"reservation store unavailable: {exc}") from exc
