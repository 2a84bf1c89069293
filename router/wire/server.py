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
headers (``idle_timeout_s`` since the connection opened or its last answer: then it closes,
idle or trickling) and the body (``body_timeout_s``: a 408). A request the parser refuses is a
400, one the screen refuses (:class:`Refused`) is answered as it says, and either way the
connection closes after the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import httptools

from router.wire.message import (
    ClientGone,
    Headers,
    Limits,
    Refused,
    Reply,
    Request,
    error_answer,
    status_head,
)
from streams.openai import error_body

__all__ = [
    "MAX_PIPELINED",
    "ClientGone",
    "Connection",
    "Headers",
    "Limits",
    "Refused",
    "Reply",
    "Request",
]

log = logging.getLogger(__name__)

MAX_PIPELINED = 8  # complete requests waiting behind the one being answered: then reading pauses
_CORK_BYTES = 16 << 10  # written within one turn of the event loop: sent at once past this

Handler = Callable[[Request, "Reply"], Awaitable[None]]
# (method, path, headers, peer) once a request's headers are in, before its body is read (and
# before its announced length is checked): it raises :class:`Refused` to answer the request so
# and close the connection (authentication before any work); what it returns goes with the
# request (``Request.screened``)
Screen = Callable[[str, str, Headers, str], Any]


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
        self.bounded = 0  # the send buffer's bound set by a reply (0: the defaults)
        self._out: list[bytes] = []  # written in this turn of the event loop, not sent yet
        self._queued = 0  # their bytes
        self._drain: asyncio.Future[None] | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._loop = asyncio.get_running_loop()
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._reading_paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._refused: Refused | None = None  # the answer to a request cut short
        self._screened: Any = None
        self._awaiting_body = False  # a request's headers are in, its body is not
        self._upgraded = False
        self._eof = False  # the client sent everything it will (a half-close)
        # the message being parsed
        self._url = b""
        self._headers = Headers()
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
        self._out, self._queued = [], 0
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
        """Queue ``data``: what is written within one turn of the event loop goes out in one
        send (a stream's head and first chunk, its last chunk and its end)."""
        if self.closed or self.transport is None:
            return
        if self._out:
            self._out.append(data)
            self._queued += len(data)
            if self._queued >= _CORK_BYTES:  # (and the transport's flow control sees it)
                self._flush()
            return
        self._out, self._queued = [data], len(data)
        self._loop.call_soon(self._flush)
        if self._queued >= _CORK_BYTES:
            self._flush()

    def _flush(self) -> None:
        out, self._out, self._queued = self._out, [], 0
        if out and not self.closed and self.transport is not None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self._flush()
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
                self._fail(error_answer(400, "upgrades are not served here"))
        except httptools.HttpParserError as exc:
            self._fail(self._refused or error_answer(400, f"malformed request: {exc}"))

    def eof_received(self) -> bool | None:
        if self._task is None and not self._queue:
            self._flush()  # (the last answer may wait for this turn's end)
            return None  # closes
        self._eof = True
        return True  # keep writing the answers; it closes after them

    # the parser's callbacks
    def on_message_begin(self) -> None:
        # (the idle timer armed at the connection's start or its last answer runs on: the
        # headers must be in within it)
        self._url, self._headers, self._count = b"", Headers(), 0
        self._body, self._size = [], 0
        self._refused = self._screened = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.max_line:
            self._refused = error_answer(414, "the request line is too long")
            raise httptools.HttpParserCallbackError("line")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count += 1
        if self._count > self.limits.max_headers or len(name) + len(value) > self.limits.max_line:
            self._refused = error_answer(431, "too many or too long headers")
            raise httptools.HttpParserCallbackError("headers")
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = self._headers.get(key)
        self._headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        if self.screen is not None:
            url = self._url
            q = url.find(b"?")
            path = (url if q < 0 else url[:q]).decode("latin-1")
            method = self._parser.get_method().decode("ascii", "replace")
            try:
                self._screened = self.screen(method, path, self._headers, self.peer)
            except Refused as exc:
                self._refused = exc
                raise httptools.HttpParserCallbackError("refused") from None
        length = self._headers.get("content-length")
        limit = self.limits.max_body
        if length is not None and length.isdigit() and int(length) > limit:
            self._refused = error_answer(
                413, f"request body of {int(length)} bytes is over the limit of {limit}"
            )
            raise httptools.HttpParserCallbackError("body")
        self._awaiting_body = True
        self._arm(self.limits.body_timeout_s)
        expect = self._headers.get("expect")
        if expect is not None and expect.lower() == "100-continue" and self._task is None:
            # the client waits for a word before it sends the body (curl does, past 1 MiB);
            # (behind an answer under way it is not said: the client sends after its wait)
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.limits.max_body:
            limit = self.limits.max_body
            self._refused = error_answer(413, f"request body is over the limit of {limit} bytes")
            raise httptools.HttpParserCallbackError("body")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._awaiting_body = False
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
            self._screened,
            parser.get_http_version(),
        )
        self._body = []
        self._screened = None
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
                reply = Reply(self, request.keep_alive, request.version != "1.0")
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
                if not reply.keep_alive or last:
                    self.close()
                    return
        finally:
            self._task = None
            closing = self.transport is None or self.transport.is_closing()
            if not self.closed and not closing:
                self._arm(self.limits.idle_timeout_s)

    def _fail(self, refused: Refused) -> None:
        """A request the connection cannot go on from: answered (when no answer is being
        written) and closed once the client has it (the rest of what it sends is not read)."""
        if self._task is None and not self.closed:
            body = refused.body
            extra = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
            out = status_head(refused.status, refused.headers, extra + b"Connection: close\r\n\r\n")
            self.write(out + body)
        self._upgraded = True  # nothing more is parsed
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
        if self._awaiting_body:
            timeout = self.limits.body_timeout_s
            self._fail(error_answer(408, f"request body not received within {timeout:g} s"))
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
