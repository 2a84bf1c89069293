"""An HTTP/1.1 server as an asyncio protocol over httptools (the C parser llhttp): what the hot
path of a router needs and nothing else.

One :class:`Connection` per client connection parses requests as bytes arrive, hands each
complete one (:class:`Request`, its body read whole and bounded) to the handler, one at a time in
order (pipelined requests wait their turn; more than :data:`MAX_PIPELINED` waiting pauses
reading), and writes the answer through :class:`Reply`: a whole body with its length, or a
chunked stream written as it comes, with the transport's flow control (a write waits while the
client's socket buffer is full) and the client's disconnect seen at once
(:attr:`Reply.closed`, :meth:`Reply.write` raising :class:`ClientGone`).

Bounded everywhere: the request line and each header (``max_line``), the number of headers
(``max_headers``), the body (``max_body``: a 413 before it is read), the time to send the
headers and the body (``read_timeout_s``: a 408), an idle kept-alive connection
(``idle_timeout_s``). A request the parser refuses is a 400 and the connection closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httptools
import orjson

from streams.openai import error_body

__all__ = ["MAX_PIPELINED", "ClientGone", "Connection", "Limits", "Reply", "Request"]

log = logging.getLogger(__name__)

MAX_PIPELINED = 8  # complete requests waiting behind the one being answered: then reading pauses

_REASONS = {
    200: b"OK",
    204: b"No Content",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    409: b"Conflict",
    413: b"Payload Too Large",
    414: b"URI Too Long",
    422: b"Unprocessable Entity",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}


class ClientGone(ConnectionError):
    """The client closed its connection (or it broke) before the answer was written."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_line: int = 8190  # the request line and each header line, bytes
    max_headers: int = 100
    max_body: int = 4 << 20
    read_timeout_s: float = 30.0  # headers and body of one request
    idle_timeout_s: float = 75.0  # a kept-alive connection with no request


@dataclass(slots=True)
class Request:
    method: str
    path: str  # without the query
    query: str
    headers: dict[str, str]  # names lower-case; a repeated header's values joined by ", "
    body: bytes
    peer: str  # the client's address
    keep_alive: bool


Handler = Callable[[Request, "Reply"], Awaitable[None]]
# (method, path, headers, peer) once a request's headers are in, before its body is read: None
# lets it through; (status, JSON body) answers it so and closes the connection (authentication
# before any work)
Screen = Callable[[str, str, dict[str, str], str], "tuple[int, bytes] | None"]


def _error(status: int, message: str) -> tuple[int, bytes]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, orjson.dumps(error_body(message, kind, status))


def _reason(status: int) -> bytes:
    return _REASONS.get(status, b"Status")


def _head(status: int, headers: Iterable[tuple[str, str]], extra: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))]
    for name, value in headers:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r}: a line break")
        lines.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
    lines.append(extra)
    return b"".join(lines)


class Reply:
    """The answer to one request: :meth:`send` (whole), or :meth:`start`, :meth:`write`…,
    :meth:`end` (chunked, as it comes)."""

    __slots__ = ("_conn", "_keep", "done", "started", "status")

    def __init__(self, conn: Connection, keep_alive: bool) -> None:
        self._conn = conn
        self._keep = keep_alive
        self.started = False  # the status line is written: the status cannot change
        self.status = 0
        self.done = False

    @property
    def closed(self) -> bool:
        """The client is gone."""
        return self._conn.closed

    def send(
        self,
        status: int,
        body: bytes = b"",
        content_type: str = "application/json",
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        """The whole answer at once (with its length)."""
        if self.started:
            raise RuntimeError("the answer is already started")
        self.started, self.status, self.done = True, status, True
        conn = b"" if self._keep else b"Connection: close\r\n"
        extra = b"Content-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            content_type.encode("latin-1"),
            len(body),
            conn,
        )
        self._conn.write(_head(status, headers, extra) + body)

    def json(self, status: int, value: Any, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.send(status, orjson.dumps(value), "application/json", headers)

    def start(
        self, status: int, content_type: str, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        """The status line and headers of a streamed answer (chunked)."""
        if self.started:
            raise RuntimeError("the answer is already started")
        self.started, self.status = True, status
        conn = b"" if self._keep else b"Connection: close\r\n"
        extra = b"Content-Type: %s\r\nTransfer-Encoding: chunked\r\n%s\r\n" % (
            content_type.encode("latin-1"),
            conn,
        )
        self._conn.write(_head(status, headers, extra))

    async def write(self, data: bytes) -> None:
        """One chunk of a streamed answer; waits while the client's buffer is full."""
        if not data:
            return
        conn = self._conn
        if conn.closed:
            raise ClientGone("the client is gone")
        conn.write(b"%x\r\n%s\r\n" % (len(data), data))
        if conn.paused:
            await conn.drain()

    def write_nowait(self, data: bytes) -> bool:
        """:meth:`write` without waiting: False when the client's buffer is full (call
        :meth:`drain`) — the relay's fast path."""
        conn = self._conn
        if conn.closed:
            raise ClientGone("the client is gone")
        if data:
            conn.write(b"%x\r\n%s\r\n" % (len(data), data))
        return not conn.paused

    async def drain(self) -> None:
        await self._conn.drain()

    def end(self) -> None:
        """The end of a streamed answer."""
        if self.done:
            return
        self.done = True
        if not self._conn.closed:
            self._conn.write(b"0\r\n\r\n")


class Connection(asyncio.Protocol):
    """One client connection (see the module's docstring)."""

    def __init__(self, handler: Handler, limits: Limits, screen: Screen | None = None) -> None:
        self.handler = handler
        self.limits = limits
        self.screen = screen
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.closed = False
        self.paused = False  # the transport's write buffer is full
        self._drain: asyncio.Future[None] | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._loop = asyncio.get_running_loop()
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._reading_paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._refused: tuple[int, bytes] | None = None  # the answer to a request cut short
        self._upgraded = False
        self._eof = False  # the client sent everything it will (a half-close)
        # the message being parsed
        self._url = b""
        self._headers: dict[str, str] = {}
        self._count = 0
        self._body: list[bytes] = []
        self._size = 0

    # the transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self._arm(self.limits.idle_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ClientGone("the client is gone"))
            self._drain.exception()  # retrieved: nobody may be waiting
        self._queue.clear()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self.closed:
            raise ClientGone("the client is gone")
        if not self.paused:
            return
        if self._drain is None:
            self._drain = self._loop.create_future()
        await self._drain

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._upgraded:
            return  # what follows an upgrade request is not HTTP: ignored, then closed
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # no protocol is upgraded to: the request is answered as any other (RFC 9110
            # lets a server ignore Upgrade), and the connection closes after it
            self._upgraded = True
            if self._task is None and not self._queue:
                self._fail(*_error(400, "upgrades are not served here"))
        except httptools.HttpParserError as exc:
            self._fail(*(self._refused or _error(400, f"malformed request: {exc}")))

    def eof_received(self) -> bool | None:
        if self._task is None and not self._queue:
            return None  # closes
        self._eof = True
        return True  # keep writing the answers; it closes after them

    # the parser's callbacks
    def on_message_begin(self) -> None:
        self._url, self._headers, self._count = b"", {}, 0
        self._body, self._size = [], 0
        self._refused = None
        self._arm(self.limits.read_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.max_line:
            self._refused = _error(414, "the request line is too long")
            raise httptools.HttpParserCallbackError("line")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count += 1
        if self._count > self.limits.max_headers or len(name) + len(value) > self.limits.max_line:
            self._refused = _error(431, "too many or too long headers")
            raise httptools.HttpParserCallbackError("headers")
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = self._headers.get(key)
        self._headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body:
            self._refused = _error(413, f"the body is larger than {self.limits.max_body} bytes")
            raise httptools.HttpParserCallbackError("body")
        if self.screen is not None:
            url = self._url
            q = url.find(b"?")
            path = (url if q < 0 else url[:q]).decode("latin-1")
            method = self._parser.get_method().decode("ascii", "replace")
            refused = self.screen(method, path, self._headers, self.peer)
            if refused is not None:
                self._refused = refused
                raise httptools.HttpParserCallbackError("refused")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.limits.max_body:
            self._refused = _error(413, f"the body is larger than {self.limits.max_body} bytes")
            raise httptools.HttpParserCallbackError("body")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._disarm()
        url = self._url
        q = url.find(b"?")
        path, query = (url, b"") if q < 0 else (url[:q], url[q + 1 :])
        parser = self._parser
        request = Request(
            parser.get_method().decode("ascii", "replace"),
            path.decode("latin-1"),
            query.decode("latin-1"),
            self._headers,
            b"".join(self._body) if len(self._body) != 1 else self._body[0],
            self.peer,
            parser.should_keep_alive(),
        )
        self._body = []
        self._queue.append(request)
        if len(self._queue) > MAX_PIPELINED and not self._reading_paused and self.transport:
            self._reading_paused = True
            self.transport.pause_reading()
        if self._task is None:
            self._task = self._loop.create_task(self._serve())

    # answering
    async def _serve(self) -> None:
        try:
            while self._queue and not self.closed:
                request = self._queue.popleft()
                if self._reading_paused and len(self._queue) <= MAX_PIPELINED // 2:
                    self._reading_paused = False
                    if self.transport is not None:
                        self.transport.resume_reading()
                reply = Reply(self, request.keep_alive)
                try:
                    await self.handler(request, reply)
                except (ClientGone, ConnectionError):
                    self.close()
                    return
                except Exception:  # a bug in a handler: a 500 if nothing was said yet
                    log.exception("unexpected error on %s %s", request.method, request.path[:200])
                    if not reply.started:
                        reply.json(500, error_body("internal error", "internal_error", 500))
                    else:
                        self.close()
                        return
                if not reply.started:
                    reply.json(500, error_body("no answer", "internal_error", 500))
                elif not reply.done:
                    reply.end()
                last = not self._queue and (self._upgraded or self._eof)
                if not request.keep_alive or last:
                    self.close()
                    return
        finally:
            self._task = None
            closing = self.transport is None or self.transport.is_closing()
            if not self.closed and not closing:
                self._arm(self.limits.idle_timeout_s)

    def _fail(self, status: int, body: bytes) -> None:
        """A request the connection cannot go on from: answered (when no answer is being
        written) and closed."""
        if self._task is None and not self.closed:
            extra = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
            self.write(_head(status, (), extra + b"Connection: close\r\n\r\n") + body)
        self.close()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self._loop.call_later(seconds, self._timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timeout(self) -> None:
        self._timer = None
        if self._task is not None:
            return  # an answer is being written: its own limits apply
        if self._url or self._headers or self._body:
            self._fail(*_error(408, "the request took too long to arrive"))
        else:
            self.close()


async def serve(
    handler: Handler,
    host: str,
    port: int,
    limits: Limits | None = None,
    screen: Screen | None = None,
    **kw: Any,
) -> asyncio.Server:
    """Listen on ``host:port`` with one :class:`Connection` per client."""
    lim = limits or Limits()
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Connection(handler, lim, screen), host, port, **kw)
