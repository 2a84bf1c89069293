"""The reservation scripts on one pipelined Redis connection of the router's own.

redis-py spends far more on each call than Redis does: a pool checkout, the command's arguments
encoded one by one, retries and observability wrappers, a pipeline object per round trip. The
router sends two scripts per request (reserve, release), so admission's share of a request's CPU
was mostly that machinery (``docs/benchmarks/proxy.md``). Here the scripts go out on a connection
the router keeps for them: the calls of one event-loop turn are packed by hiredis and written in
one send, and hiredis' C reader hands the replies back in order. Several batches may be in
flight at once (Redis answers in the order it was sent). (Releases held back a few milliseconds
to ride with the next reservations cut the round trips by 40 % and saved no CPU: measured, not
kept.)

Failures are redis-py's, so callers catch what they caught before: a connect that fails or takes
longer than ``connect_timeout_s``, or replies that take longer than ``timeout_s``, drop the
connection and fail every call waiting on it (:class:`redis.exceptions.ConnectionError` /
:class:`redis.exceptions.TimeoutError`); the next call connects again. An error reply fails its
own call alone; ``NOSCRIPT`` (the server lost its scripts) sends the script itself once.

Only plain TCP connections are served here; TLS, Unix sockets and Sentinels keep redis-py's
pipelines (:class:`admission.redis_batch.ScriptBatcher`), which take the same calls.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Coroutine, Sequence
from typing import Any, cast

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["Batching", "ScriptCall", "ScriptLink", "fail"]

ScriptCall = tuple[AsyncScript, Sequence[Any], Sequence[Any], "asyncio.Future[Any]"]


class Batching:
    """Calls gathered per event-loop turn; ``_send`` takes each gathered batch (subclasses say
    how)."""

    def __init__(self, max_batch: int = 128) -> None:
        self.max_batch = max_batch
        self._pending: list[ScriptCall] = []
        self._soon: asyncio.Handle | None = None  # a flush at the end of this loop turn
        self._lingering = False  # ``_soon`` is a lingered call's timer, not this turn's end
        self._tasks: set[asyncio.Task[None]] = set()  # round trips under way
        self.round_trips = 0
        self.calls = 0

    async def run(
        self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any], linger_s: float = 0.0
    ) -> Any:
        """``script(keys, args)``, sent with the other calls of this loop turn; ``linger_s``:
        a call that may wait that long for others to go with it (a release: it goes with the
        next reservation instead of a round trip of its own)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, keys, args, fut))
        if len(self._pending) >= self.max_batch:
            self.flush()
        elif linger_s <= 0:
            if self._soon is None or self._lingering:
                if self._soon is not None:
                    self._soon.cancel()
                self._soon, self._lingering = loop.call_soon(self.flush), False
        elif self._soon is None:
            self._soon, self._lingering = loop.call_later(linger_s, self.flush), True
        return await fut

    def flush(self) -> None:
        """Send what is gathered (at the end of the loop turn, when a batch is full, at
        shutdown)."""
        if self._soon is not None:
            self._soon.cancel()
            self._soon, self._lingering = None, False
        batch, self._pending = self._pending, []
        if batch:
            self.round_trips += 1
            self.calls += len(batch)
            self._send(batch)

    def _send(self, batch: list[ScriptCall]) -> None:
        raise NotImplementedError

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """A round trip as a task of its own, kept until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if fut.done():
        return
    if isinstance(exc, asyncio.CancelledError):  # the round trip was cancelled (shutdown)
        fut.cancel()
    else:
        fut.set_exception(exc)


class _Waiter:
    __slots__ = ("call", "fut", "retried", "sent_at")

    def __init__(self, call: ScriptCall | None, fut: asyncio.Future[Any], sent_at: float) -> None:
        self.call, self.fut, self.sent_at = call, fut, sent_at
        self.retried = False


class _Resp(asyncio.Protocol):
    """One connection: commands written, replies matched to their waiters in order."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.waiting: deque[_Waiter] = deque()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def send(self, commands: list[bytes], waiters: list[_Waiter]) -> None:
        if self.transport is None or not self.usable:
            exc = RedisConnectionError("Redis connection closed")
            for w in waiters:
                fail(w.fut, exc)
            return
        self.waiting.extend(waiters)
        self.transport.write(b"".join(commands))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._check)

    def _check(self) -> None:
        """Replies overdue: the connection is dropped (its order can no longer be trusted)."""
        self._timer = None
        if not self.waiting:
            return
        late = time.monotonic() - self.waiting[0].sent_at
        if late >= self.timeout_s:
            self.abort(RedisTimeoutError(f"Redis did not answer within {self.timeout_s:g} s"))
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.timeout_s - late, self._check)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self.abort(RedisConnectionError(f"Redis protocol error: {exc}"))
                return
            if reply is False:
                return
            if not self.waiting:  # nothing asked for this: the stream is out of step
                self.abort(RedisConnectionError("Redis sent a reply nobody asked for"))
                return
            w = self.waiting.popleft()
            if isinstance(reply, ResponseError):
                if str(reply).startswith("NOSCRIPT") and w.call is not None and not w.retried:
                    w.retried = True  # the script itself, once; its reply comes after the rest
                    script, keys, args, _ = w.call
                    w.sent_at = time.monotonic()
                    self.send([_eval(script, keys, args)], [w])
                    continue
                fail(w.fut, reply)
            elif not w.fut.done():
                w.fut.set_result(reply)

    def abort(self, exc: BaseException) -> None:
        self._fail_all(exc)
        if self.transport is not None:
            self.transport.abort()

    def _fail_all(self, exc: BaseException) -> None:
        while self.waiting:
            fail(self.waiting.popleft().fut, exc)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(RedisConnectionError(f"Redis connection lost: {exc or 'closed'}"))
        if not self.closed.done():
            self.closed.set_result(None)


def _evalsha(script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> bytes:
    return bytes(hiredis.pack_command(("EVALSHA", script.sha, len(keys), *keys, *args)))


def _eval(script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> bytes:
    return bytes(hiredis.pack_command(("EVAL", script.script, len(keys), *keys, *args)))


class ScriptLink(Batching):
    """Script calls on one pipelined connection to ``host:port`` (see the module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        timeout_s: float = 1.0,
        connect_timeout_s: float = 1.0,
        max_batch: int = 128,
    ) -> None:
        super().__init__(max_batch)
        self.host, self.port, self.db = host, port, db
        self.username, self.password = username, password
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._conn: _Resp | None = None
        self._connecting: asyncio.Task[_Resp] | None = None

    @classmethod
    def of(cls, client: Redis, max_batch: int = 128) -> ScriptLink | None:
        """A link to ``client``'s server, or None when its connections are not plain TCP."""
        pool = client.connection_pool
        kw = pool.connection_kwargs
        if pool.connection_class is not Connection or "host" not in kw:
            return None
        timeout = kw.get("socket_timeout") or 1.0
        return cls(
            kw["host"],
            int(kw.get("port") or 6379),
            username=kw.get("username"),
            password=kw.get("password"),
            db=int(kw.get("db") or 0),
            timeout_s=timeout,
            connect_timeout_s=kw.get("socket_connect_timeout") or timeout,
            max_batch=max_batch,
        )

    def _send(self, batch: list[ScriptCall]) -> None:
        conn = self._conn
        if conn is not None and conn.usable:
            self._write(conn, batch)
        else:
            self._spawn(self._send_connected(batch))

    def _write(self, conn: _Resp, batch: list[ScriptCall]) -> None:
        now = time.monotonic()
        commands, waiters = [], []
        for call in batch:
            script, keys, args, fut = call
            try:
                commands.append(_evalsha(script, keys, args))
            except (TypeError, ValueError) as exc:  # an argument hiredis cannot pack
                fail(fut, exc)
                continue
            waiters.append(_Waiter(call, fut, now))
        conn.send(commands, waiters)

    async def _send_connected(self, batch: list[ScriptCall]) -> None:
        try:
            conn = await self._connect()
        except BaseException as exc:
            for *_, fut in batch:
                fail(fut, exc)
            return
        self._write(conn, batch)

    async def _connect(self) -> _Resp:
        """The connection, opened (and authenticated) by the first caller that finds none."""
        if self._connecting is None or self._connecting.done():
            conn = self._conn
            if conn is not None and conn.usable:
                return conn
            self._connecting = asyncio.get_running_loop().create_task(self._open())
        return await asyncio.shield(self._connecting)

    async def _open(self) -> _Resp:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Resp(self.timeout_s), self.host, self.port
                )
                hello: list[tuple[Any, ...]] = []
                if self.password is not None:
                    auth = (self.username, self.password) if self.username else (self.password,)
                    hello.append(("AUTH", *auth))
                if self.db:
                    hello.append(("SELECT", self.db))
                if hello:
                    futs = [loop.create_future() for _ in hello]
                    now = time.monotonic()
                    conn.send(
                        [bytes(hiredis.pack_command(c)) for c in hello],
                        [_Waiter(None, f, now) for f in futs],
                    )
                    try:
                        await asyncio.gather(*futs)
                    except BaseException:  # refused (wrong password, no such database)
                        conn.abort(RedisConnectionError("Redis refused the connection"))
                        raise
        except TimeoutError as exc:
            raise RedisTimeoutError(
                f"Redis at {self.host}:{self.port}: no connection within "
                f"{self.connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            raise RedisConnectionError(
                f"Redis at {self.host}:{self.port} unreachable: {exc}"
            ) from exc
        self._conn = conn
        return conn

    async def aclose(self) -> None:
        """Send what is gathered, wait (bounded) for the replies, close the connection."""
        self.flush()
        if self._tasks:  # batches waiting for a connection
            await asyncio.wait(set(self._tasks), timeout=self.connect_timeout_s)
        conn = self._conn
        if conn is None or conn.transport is None:
            return
        if conn.waiting:
            await asyncio.wait([w.fut for w in conn.waiting], timeout=self.timeout_s)
        conn.transport.close()
        try:
            async with asyncio.timeout(self.timeout_s):
                await conn.closed
        except TimeoutError:
            conn.abort(RedisConnectionError("closed"))
        self._conn = None
