"""One HTTP/1.1 exchange on router/wire: the request as the server hands it over
(:class:`Request`, its :class:`Headers`), the answer written through :class:`Reply` (whole with
its length, or chunked as it comes — the bytes of an HTTP/1.0 client's stream as they are — with
the connection's flow control), the server's :class:`Limits`, and a screen's :class:`Refused`.
The connection itself is router/wire/server.py."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from streams.openai import error_body

if TYPE_CHECKING:
    from router.wire.server import Connection

__all__ = [
    "ClientGone",
    "Headers",
    "Limits",
    "Refused",
    "Reply",
    "Request",
    "error_answer",
    "status_head",
]

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


class Refused(Exception):
    """Raised by a :data:`Screen`: the request is answered so, its body is not read, and the
    connection closes."""

    def __init__(self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(status)
        self.status, self.body, self.headers = status, body, tuple(headers)


class Headers(dict[str, str]):
    """A request's headers: names stored lower-case, looked up in any case (a repeated
    header's values joined by ``", "``)."""

    __slots__ = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and dict.__contains__(self, key.lower())


@dataclass(frozen=True, slots=True)
class Limits:
    max_line: int = 8190  # the request line and each header line, bytes
    max_headers: int = 100
    max_body: int = 4 << 20
    body_timeout_s: float = 30.0  # the body of one request, from its headers' end (a 408)
    # a connection that has not sent a request's whole headers for this long since it opened
    # or its last answer is closed, idle or trickling them (slowloris)
    idle_timeout_s: float = 75.0


@dataclass(slots=True)
class Request:
    method: str
    path: str  # without the query
    query: str
    headers: Headers
    body: bytes
    peer: str  # the client's address
    keep_alive: bool
    screened: Any = None  # what the screen returned for it
    version: str = "1.1"

    async def read(self) -> bytes:
        """The body (read whole, within the listener's limits, before the handler ran)."""
        return self.body


def error_answer(status: int, message: str) -> Refused:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return Refused(status, orjson.dumps(error_body(message, kind, status)))


def _reason(status: int) -> bytes:
    return _REASONS.get(status, b"Status")


def status_head(status: int, headers: Iterable[tuple[str, str]], extra: bytes) -> bytes:
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

    __slots__ = ("_chunked", "_conn", "done", "keep_alive", "started", "status")

    def __init__(self, conn: Connection, keep_alive: bool, chunked: bool = True) -> None:
        self._conn = conn
        self.keep_alive = keep_alive  # False: the connection closes after this answer
        # an HTTP/1.0 client knows no chunks: its stream is the bytes, ended by the close
        self._chunked = chunked
        if not chunked:
            self.keep_alive = False
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
        close: bool = False,
    ) -> None:
        """The whole answer at once (with its length); ``close``: and then the connection
        (the rest of a request's body is not worth reading)."""
        if self.started:
            raise RuntimeError("the answer is already started")
        self.started, self.status, self.done = True, status, True
        if close:
            self.keep_alive = False
        conn = b"" if self.keep_alive else b"Connection: close\r\n"
        extra = b"Content-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            content_type.encode("latin-1"),
            len(body),
            conn,
        )
        self._conn.write(status_head(status, headers, extra) + body)

    def json(self, status: int, value: Any, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.send(status, orjson.dumps(value), "application/json", headers)

    def start(
        self, status: int, content_type: str, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        """The status line and headers of a streamed answer (chunked)."""
        if self.started:
            raise RuntimeError("the answer is already started")
        self.started, self.status = True, status
        conn = b"" if self.keep_alive else b"Connection: close\r\n"
        framing = b"Transfer-Encoding: chunked\r\n" if self._chunked else b""
        extra = b"Content-Type: %s\r\n%s%s\r\n" % (
            content_type.encode("latin-1"),
            framing,
            conn,
        )
        self._conn.write(status_head(status, headers, extra))

    async def write(self, data: bytes) -> None:
        """One chunk of a streamed answer; waits while the client's buffer is full."""
        if not data:
            return
        conn = self._conn
        if conn.closed:
            raise ClientGone("the client is gone")
        conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        if conn.paused:
            await conn.drain()

    def write_nowait(self, data: bytes) -> bool:
        """:meth:`write` without waiting: False when the client's buffer is full (call
        :meth:`drain`) — the relay's fast path."""
        conn = self._conn
        if conn.closed:
            raise ClientGone("the client is gone")
        if data:
            conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        return not conn.paused

    async def drain(self) -> None:
        await self._conn.drain()

    def bound(self, size: int) -> None:
        """Buffer at most about ``size`` bytes for the client in the kernel and as much in the
        transport: a client that stops reading shows as a write that waits, soon."""
        conn = self._conn
        t = conn.transport
        if t is None or conn.bounded == size:
            return
        conn.bounded = size  # (for the connection's later answers too)
        sock = t.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        t.set_write_buffer_limits(high=size)

    def abort(self) -> None:
        """Drop the connection at once (a client that takes nothing: nothing more is sent)."""
        t = self._conn.transport
        if t is not None:
            t.abort()

    def end(self) -> None:
        """The end of a streamed answer."""
        if self.done:
            return
        self.done = True
        if self._chunked and not self._conn.closed:
            self._conn.write(b"0\r\n\r\n")
