"""The reservation scripts' own Redis connection (admission/resp.py) on the real Redis: calls of
one loop turn share a send and each gets its own reply, an error reply fails its call alone, a
server that lost its scripts gets them again, the database and password of the URL are used, and
a server that does not answer or is not there fails the waiting calls within the timeout."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from admission.redis_batch import ScriptBatcher
from admission.redis_store import RedisReservations
from admission.reservations import ReserveAsk
from admission.resp import ScriptLink
from tests.conftest import REDIS

pytestmark = pytest.mark.integration

_INCR = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
_FAIL_ODD = "if tonumber(ARGV[1]) % 2 == 1 then return redis.error_reply('ODD') end return ARGV[1]"


async def _silent_server() -> tuple[asyncio.Server, int]:
    """Accepts connections and never answers (a hung Redis)."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client goes
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
async def client() -> AsyncIterator[Redis]:
    c = Redis.from_url(REDIS)
    yield c
    await c.aclose()


async def test_calls_of_one_turn_share_a_round_trip_and_get_their_own_replies(
    client: Redis,
) -> None:
    link = ScriptLink.of(client)
    assert link is not None  # a plain TCP URL: served by the link, not redis-py
    incr = client.register_script(_INCR)
    key = f"test:link:{uuid.uuid4().hex[:8]}"
    replies = await asyncio.gather(*(link.run(incr, [key], [i]) for i in range(1, 51)))
    assert sorted(replies) == sorted(set(replies))  # every call its own reply
    assert max(replies) == sum(range(1, 51)) == int(await client.get(key) or 0)
    assert link.round_trips == 1 and link.calls == 50
    await link.aclose()


@pytest.mark.parametrize("make", [ScriptLink.of, ScriptBatcher])
async def test_a_lingering_call_goes_with_the_next_call_or_after_its_linger(
    client: Redis, make: Any
) -> None:
    """A release lingers for the next reservation: the two share one round trip; alone, it
    goes when its linger is over (not at the end of its loop turn, not never)."""
    link = make(client)
    assert link is not None
    incr = client.register_script(_INCR)
    key = f"test:link:{uuid.uuid4().hex[:8]}"
    lingering = asyncio.ensure_future(link.run(incr, [key], [1], 30.0))
    for _ in range(5):  # loop turns pass: the lingering call waits
        await asyncio.sleep(0)
    assert not lingering.done() and link.round_trips == 0
    assert await link.run(incr, [key], [10]) in (10, 11)  # sent at once, the lingerer with it
    assert await lingering in (1, 11)
    assert link.round_trips == 1 and link.calls == 2
    alone = asyncio.ensure_future(link.run(incr, [key], [100], 0.05))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not alone.done() and link.round_trips == 1  # not at the end of its loop turn
    assert await alone == 111  # ... but once its linger is over
    assert link.round_trips == 2
    await link.aclose()


async def test_an_error_reply_fails_its_own_call_alone(client: Redis) -> None:
    link = ScriptLink.of(client)
    assert link is not None
    odd = client.register_script(_FAIL_ODD)
    out = await asyncio.gather(*(link.run(odd, [], [i]) for i in range(6)), return_exceptions=True)
    assert [isinstance(x, ResponseError) for x in out] == [False, True] * 3
    assert out[0::2] == [b"0", b"2", b"4"]
    await link.aclose()


async def test_a_server_that_lost_its_scripts_gets_them_again(client: Redis) -> None:
    link = ScriptLink.of(client)
    assert link is not None
    incr = client.register_script(_INCR)
    key = f"test:link:{uuid.uuid4().hex[:8]}"
    await link.run(incr, [key], [1])
    await client.script_flush()  # e.g. Redis restarted without persistence
    assert await asyncio.gather(link.run(incr, [key], [2]), link.run(incr, [key], [3])) in (
        [3, 6],
        [4, 6],  # (the two may run in either order once loaded again)
        [6, 4],
    )
    await link.aclose()


async def test_the_database_of_the_url_is_the_one_written() -> None:
    c = Redis.from_url(REDIS.rsplit("/", 1)[0] + "/3")
    link = ScriptLink.of(c)
    assert link is not None and link.db == 3
    key = f"test:link:{uuid.uuid4().hex[:8]}"
    await link.run(c.register_script(_INCR), [key], [7])
    assert int(await c.get(key) or 0) == 7  # redis-py's client reads database 3
    zero = Redis.from_url(REDIS)
    assert await zero.get(key) is None
    await link.aclose()
    await c.aclose()
    await zero.aclose()


async def test_a_password_the_server_refuses_fails_the_call(client: Redis) -> None:
    c = Redis.from_url(REDIS, password="not-configured")
    link = ScriptLink.of(c)
    assert link is not None and link.password == "not-configured"
    with pytest.raises(ResponseError):  # "AUTH ... called without any password configured"
        await link.run(client.register_script(_INCR), ["k"], [1])
    await link.aclose()
    await c.aclose()


async def test_a_silent_server_fails_the_waiting_calls_within_the_timeout(client: Redis) -> None:
    server, port = await _silent_server()
    link = ScriptLink("127.0.0.1", port, timeout_s=0.3, connect_timeout_s=0.3)
    incr = client.register_script(_INCR)
    started = time.monotonic()
    out = await asyncio.gather(
        *(link.run(incr, ["k"], [1]) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(x, RedisTimeoutError) for x in out)
    assert time.monotonic() - started < 1.0
    server.close()
    await link.aclose()


async def test_a_server_not_there_fails_at_once_and_the_next_call_connects_again(
    client: Redis,
) -> None:
    link = ScriptLink("127.0.0.1", 1, timeout_s=0.5, connect_timeout_s=0.5)
    incr = client.register_script(_INCR)
    with pytest.raises(RedisConnectionError):
        await link.run(incr, ["k"], [1])
    # the same link pointed at the real server (a Redis that came back) serves the next call
    link.host, link.port = (
        client.connection_pool.connection_kwargs["host"],
        int(client.connection_pool.connection_kwargs["port"]),
    )
    key = f"test:link:{uuid.uuid4().hex[:8]}"
    assert await link.run(incr, [key], [5]) == 5
    await link.aclose()


async def test_the_store_uses_the_link_and_redis_py_where_it_cannot(client: Redis) -> None:
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    store = RedisReservations(client, prefix)
    assert isinstance(store.batch, ScriptLink)
    await store.mark_generation("test")
    ask = ReserveAsk(rid="r1", pool="p", kv_blocks=4, limit_blocks=10, lease_s=30.0)
    got = await store.reserve_unguarded(ask, time.time())
    assert isinstance(got, tuple) and got[1:] == (4, 1)
    assert (await store.release("r1", time.time())) is not None
    assert await store.held("p") == (0, 0)
    await store.aclose()
    tls = Redis.from_url(REDIS.replace("redis://", "rediss://"))
    assert isinstance(RedisReservations(tls, prefix).batch, ScriptBatcher)
    await tls.aclose()
