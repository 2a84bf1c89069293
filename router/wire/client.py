"""An HTTP/1.1 client to the engines as an asyncio protocol over httptools: kept-alive
connections per engine, the answer's body handed over as it arrives (chunked encoding removed
by the parser, nothing else touched), the engine's pace followed (reading pauses while the
consumer is behind by more than :data:`HIGH_WATER` bytes).

:meth:`Pool.request` sends one request and returns an :class:`Answer` once the engine's status
and headers are in; :meth:`Answer.chunks` yields the body's bytes as they come,
:meth:`Answer.read` reads it whole. A connection goes back to its pool only after a complete
answer that allows keeping it; anything else (an error, an answer not read to its end) closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from urllib.parse import urlsplit

import httptools

__all__ = ["HIGH_WATER", "Answer", "Pool", "Pools", "UpstreamError"]

HIGH_WATER = 256 * 1024  # body bytes buffered before reading from the engine pauses


class UpstreamError(ConnectionError):
    """The engine's connection failed, or its answer is not HTTP."""


class Cut(UpstreamError):
    """The router closed an engine's answer itself (:meth:`Answer.cut`)."""


class _Conn(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._loop = asyncio.get_running_loop()
        self.answer: Answer | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._lost(self)
        self.pool.busy.discard(self)
        if self.answer is not None:
            self.answer._fail(UpstreamError(f"the engine closed the connection ({exc})"))

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.answer is not None:
                self.answer._fail(UpstreamError(f"the engine's answer is not HTTP: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        return None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    def send(self, data: bytes, answer: Answer) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.answer = answer
        self.pool.busy.add(self)
        assert self.transport is not None
        self.transport.write(data)

    # the parser's callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.answer is not None:
            self.answer.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        a = self.answer
        if a is not None:
            a.status = self._parser.get_status_code()
            a.keep_alive = self._parser.should_keep_alive()
            if not a._ready.done():
                a._ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        a = self.answer
        if a is not None:
            a._chunk(body)

    def on_message_complete(self) -> None:
        a = self.answer
        if a is not None:
            a._complete()


class Answer:
    """The engine's answer to one request."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_ready",
        "_sink",
        "_sink_error",
        "_waiter",
        "headers",
        "keep_alive",
        "last",
        "status",
    )

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self._ready: asyncio.Future[None] = conn._loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        # while the reader waits with nothing queued: takes each piece as it arrives
        self._sink: Callable[[bytes], bool] | None = None
        self._sink_error: BaseException | None = None
        self._done = False
        self._error: Exception | None = None
        self.status = 0
        self.keep_alive = False
        self.headers: dict[str, str] = {}
        self.last = conn._loop.time()  # when the engine last sent anything (or it was sent)

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/octet-stream").split(";")[0]

    # from the connection
    def _chunk(self, data: bytes) -> None:
        self.last = self._conn._loop.time()
        sink = self._sink
        if sink is not None:  # the reader waits with nothing queued: nothing goes before it
            try:
                if sink(data):
                    return
                self._chunks.append(b"")  # taken, but the reader must wait for its consumer
            except Exception as exc:  # raised to the reader, where it would have been
                self._sink_error = exc
            self._sink = None
            self._wake()
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and self._conn.transport is not None:
            self._conn.transport.pause_reading()
        self._wake()

    def _complete(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, exc: Exception) -> None:
        if self._done or self._error is not None:
            return  # (the first failure is the one that counts)
        self._error = exc
        if not self._ready.done():
            self._ready.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # for the caller
    async def chunks(self, sink: Callable[[bytes], bool] | None = None) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (several small pieces may come as one). With a
        ``sink``, a piece that arrives while the reader waits with nothing queued goes to the
        sink at once, from the connection's callback — no wake-up of the reader per piece; the
        sink returns False when its consumer is full (it took the piece: the reader then gets
        an empty piece, its cue to wait for the consumer) and whatever it raises, the reader
        raises. Pieces queued otherwise come out here as without a sink, in order."""
        conn = self._conn
        while True:
            if self._sink_error is not None:
                exc, self._sink_error = self._sink_error, None
                raise exc
            if self._chunks:
                if not self._chunks[0]:  # the sink's cue (always first: it found none queued)
                    self._chunks.popleft()
                    yield b""
                    continue
                data = (
                    self._chunks.popleft()
                    if len(self._chunks) == 1
                    else b"".join(self._chunks.popleft() for _ in range(len(self._chunks)))
                )
                if self._buffered > HIGH_WATER and conn.transport is not None:
                    conn.transport.resume_reading()
                self._buffered = 0
                yield data
                continue
            if self._done:
                self.release()
                return
            if self._error is not None:
                raise self._error
            self._waiter = conn._loop.create_future()
            self._sink = sink
            try:
                await self._waiter
            finally:
                self._sink = None
                self._waiter = None

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def cut(self, why: str) -> None:
        """End this answer from the router's side: its reader gets :class:`Cut`, the engine's
        connection closes (the engine aborts the request and frees its KV)."""
        self._fail(Cut(why))
        if self._conn.answer is self:
            self._conn.close()

    def release(self) -> None:
        """Done with it: the connection goes back to the pool when the answer was complete and
        may be kept, else it closes."""
        conn = self._conn
        if conn.answer is not self:
            return
        conn.answer = None
        conn.pool.busy.discard(conn)
        if self._done and self.keep_alive and not conn.closed:
            conn.pool._idle(conn)
        else:
            conn.close()


class Pool:
    """Kept-alive connections to one engine (``host:port``)."""

    def __init__(
        self,
        host: str,
        port: int,
        max_idle: int = 256,
        connect_timeout_s: float = 5.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.max_idle = max_idle
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self._free: list[_Conn] = []
        self.busy: set[_Conn] = set()  # connections with an answer under way
        self._host_header = f"{host}:{port}".encode("latin-1")

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self), self.host, self.port, ssl=self.tls
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return conn

    def _idle(self, conn: _Conn) -> None:
        if len(self._free) < self.max_idle:
            self._free.append(conn)
        else:
            conn.close()

    def _lost(self, conn: _Conn) -> None:
        if conn in self._free:
            self._free.remove(conn)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Iterable[tuple[str, str]] = (),
    ) -> Answer:
        """Send one request; the answer once its status and headers are in. No timeout of its
        own: the caller bounds the wait (``asyncio.timeout``), as the router bounds a stream."""
        head = [
            b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n"
            % (method.encode("ascii"), path.encode("latin-1"), self._host_header, len(body))
        ]
        for name, value in headers:
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name!r}: a line break")
            head.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
        head.append(b"\r\n")
        data = b"".join(head) + body
        for attempt in (0, 1):
            conn = None
            while self._free and conn is None:
                c = self._free.pop()
                conn = None if c.closed else c
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            answer = Answer(conn)
            conn.send(data, answer)
            try:
                await answer._ready
            except UpstreamError:
                conn.answer = None
                conn.close()
                # a kept-alive connection the engine closed meanwhile: once more, on a new one
                if reused and attempt == 0 and answer.status == 0:
                    continue
                raise
            except BaseException:
                conn.answer = None
                conn.close()
                raise
            return answer
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conn in [*self._free, *self.busy]:
            conn.close()
        self._free.clear()

    def expire(self, before: float) -> None:
        """Fail the answers the engine has sent nothing for since ``before`` (loop time)."""
        for conn in list(self.busy):
            a = conn.answer
            if a is not None and a.last < before:
                a._fail(TimeoutError("the engine sent nothing in time"))
                conn.close()


class Pools:
    """A :class:`Pool` per engine endpoint (``http[s]://host:port[/prefix]``), and the one
    limit on how long an engine may send nothing while an answer is under way
    (``idle_timeout_s``: the answer fails with a :class:`TimeoutError`), kept by one sweep
    (not a timer per chunk)."""

    def __init__(self, connect_timeout_s: float = 5.0, idle_timeout_s: float = 300.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._pools: dict[str, tuple[Pool, str]] = {}
        self._sweep: asyncio.Task[None] | None = None
        self._tls: ssl.SSLContext | None = None

    def of(self, endpoint: str) -> tuple[Pool, str]:
        """The pool of ``endpoint`` and the path prefix its requests' paths go after."""
        found = self._pools.get(endpoint)
        if found is not None:
            return found
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"not an http(s) endpoint: {endpoint[:200]!r}")
        tls = None
        if parts.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        port = parts.port or (443 if tls is not None else 80)
        pool = Pool(parts.hostname, port, connect_timeout_s=self.connect_timeout_s, tls=tls)
        found = (pool, parts.path.rstrip("/"))
        self._pools[endpoint] = found
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().create_task(self._sweeping())
        return found

    async def _sweeping(self) -> None:
        loop = asyncio.get_running_loop()
        every = max(0.05, min(1.0, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(every)
            before = loop.time() - self.idle_timeout_s
            for pool, _ in list(self._pools.values()):
                pool.expire(before)

    async def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweep
            self._sweep = None
        for pool, _ in self._pools.values():
            pool.close()
        self._pools.clear()
