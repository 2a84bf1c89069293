"""The router's Redis client: one primary at a URL, or the primary a set of Sentinels names,
followed through their failovers.

Either way the pool is bounded and waited for (redis-py's default pool refuses the command past
its size: "Too many connections", which failed admissions and releases under load), and every
connect and read is bounded by ``socket_timeout_s``: a primary that went away fails a call
within it, and admission goes on without it (admission/failover.py). Through Sentinels, a
connection that finds its server demoted to a replica is dropped, and the next one asks the
Sentinels for the new primary.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from admission.settings import RedisSettings

__all__ = ["redis_client"]


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The Sentinels' primary, with the blocking pool's bound and wait."""


def _db(url: str) -> int:
    path = urlparse(url).path.strip("/")
    return int(path) if path.isdigit() else 0


def redis_client(s: RedisSettings) -> Redis:
    password = s.password.get_secret_value() if s.password else None
    if not s.sentinels:
        pool = BlockingConnectionPool.from_url(
            s.url,
            password=password,
            socket_timeout=s.socket_timeout_s,
            socket_connect_timeout=s.socket_timeout_s,
            max_connections=s.max_connections,
            timeout=s.pool_timeout_s,
        )
        return Redis.from_pool(pool)  # closing the client closes the pool
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": s.socket_timeout_s,
        "socket_connect_timeout": s.socket_timeout_s,
    }
    if s.sentinel_password is not None:
        sentinel_kwargs["password"] = s.sentinel_password.get_secret_value()
    hosts = [(h, int(p)) for h, _, p in (x.rpartition(":") for x in s.sentinels)]
    # typed from redis-py 8.2 on, untyped before: called through Any to check under both
    make_sentinel: Any = Sentinel
    sentinel = make_sentinel(hosts, sentinel_kwargs=sentinel_kwargs)
    client: Redis = sentinel.master_for(
        s.sentinel_service,
        connection_pool_class=_BlockingSentinelPool,
        password=password,
        db=_db(s.url),
        socket_timeout=s.socket_timeout_s,
        socket_connect_timeout=s.socket_timeout_s,
        max_connections=s.max_connections,
        timeout=s.pool_timeout_s,
    )
    return client
