"""A small HTTP/2 server connection, enough for gRPC (RFC 9113; the endpoint picker's transport
with ``router.epp_transport: native``, router/eppnative.py).

One asyncio protocol per connection: frames parsed from the bytes as they come, the frames a
turn produces written in one send. What gRPC needs and nothing more: streams opened by the
client's HEADERS (with CONTINUATION), DATA in and out, trailers, RST_STREAM, SETTINGS, PING,
WINDOW_UPDATE and GOAWAY; no server push, no priorities (read and ignored), no TLS. Flow
control both ways: what the client sends is bounded by the windows this side grants (granted
again as the application consumes it); what this side sends waits for the client's windows
and goes in frames no larger than the client's ``SETTINGS_MAX_FRAME_SIZE``. Header blocks are
HPACK-decoded by ``hpack`` (its decoder keeps the dynamic table in step) and bounded in size;
anything against the protocol ends the connection with GOAWAY and the error code.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Callable
from typing import Protocol, cast

from hpack import Decoder, HPACKError

from router.h2frames import (
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_HEADER_LIST,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RECV_WINDOW,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    StreamsError,
    frame,
)

__all__ = ["H2Connection", "H2Stream", "StreamHandler"]

log = logging.getLogger(__name__)

PREFACE_TIMEOUT_S = 10.0


class StreamHandler(Protocol):
    def data(self, stream: H2Stream, chunk: bytes, end: bool) -> None: ...
    def reset(self, stream: H2Stream) -> None: ...


class H2Stream:
    """One request stream: its headers, and what this side sends on it."""

    __slots__ = (
        "conn", "done", "handler", "headers", "id", "pending", "recv", "room", "sent", "window",
    )  # fmt: skip

    def __init__(self, conn: H2Connection, sid: int, headers: list[tuple[str, str]]) -> None:
        self.conn, self.id, self.headers = conn, sid, headers
        self.window = conn.peer_window  # what the client lets this side send on it
        self.recv = 0  # bytes received and consumed since the last grant
        self.room = RECV_WINDOW  # what the client may still send on it (its receive window)
        self.sent = False  # response headers sent
        self.done = False  # ended (either side): nothing more is sent
        self.pending: deque[tuple[bytes, bool]] = deque()  # DATA waiting for a window
        self.handler: StreamHandler | None = None

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def respond(self, block: bytes) -> None:
        """The response's headers (an encoded block: :func:`encode_headers`)."""
        if not self.sent and not self.done:
            self.sent = True
            self.conn.out.append(frame(HEADERS, END_HEADERS, self.id, block))
            self.conn.flush_soon()

    def send(self, data: bytes) -> None:
        if not self.done:
            self.pending.append((data, False))
            self.conn.pump(self)

    def end(self, trailers: bytes) -> None:
        """The trailers (an encoded block), after everything sent before them."""
        if not self.done:
            self.pending.append((trailers, True))
            self.conn.pump(self)

    def consumed(self, n: int) -> None:
        """The application took ``n`` bytes of this stream's DATA: the client may send more."""
        self.conn.consumed(self, n)


class H2Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection; ``on_stream`` is told of every stream the
    client opens (its headers complete) and gives the stream's handler (None: refused)."""

    def __init__(
        self, on_stream: Callable[[H2Stream], StreamHandler | None], max_streams: int = 1024
    ) -> None:
        self.on_stream = on_stream
        self.max_streams = max_streams
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.preface = False
        self.decoder = Decoder(max_header_list_size=MAX_HEADER_LIST)
        self.streams: dict[int, H2Stream] = {}
        self.last_stream = 0
        self.peer_window = DEFAULT_WINDOW  # the client's SETTINGS_INITIAL_WINDOW_SIZE
        self.peer_frame = DEFAULT_FRAME
        self.send_window = DEFAULT_WINDOW  # the connection's, for what this side sends
        self.recv_unacked = 0  # DATA received and consumed, not granted again yet
        self.recv_window = RECV_WINDOW * 16  # what the client may still send on the connection
        self._no_preface: asyncio.TimerHandle | None = None
        self.headers_open: tuple[int, int, bytearray] | None = None  # (stream, flags, block)
        self.out: list[bytes] = []
        self._flush_scheduled = False
        self._reading = False  # in data_received: what is answered goes in its one write
        self.closed = False

    # --- the transport ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        settings = struct.pack(">HIHIHI", 3, self.max_streams, 4, RECV_WINDOW, 6, MAX_HEADER_LIST)
        grant = struct.pack(">I", RECV_WINDOW * 16 - DEFAULT_WINDOW)
        self.transport.write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, grant))
        # a connection that never says it speaks HTTP/2 is not kept open
        self._no_preface = asyncio.get_running_loop().call_later(
            PREFACE_TIMEOUT_S, self._preface_late
        )

    def _preface_late(self) -> None:
        if not self.preface and not self.closed:
            self._goaway(PROTOCOL_ERROR, f"no connection preface within {PREFACE_TIMEOUT_S} s")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._no_preface is not None:
            self._no_preface.cancel()
        for s in list(self.streams.values()):
            self._reset(s)

    def close(self) -> None:
        """Say GOAWAY and close the connection (the server stops)."""
        if not self.closed:
            self._goaway(0, "the server stops")

    def flush_soon(self) -> None:
        if not self._flush_scheduled and not self._reading:  # (a read flushes at its end)
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if self.out and self.transport is not None and not self.closed:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def data_received(self, data: bytes) -> None:
        self._reading = True
        try:
            self._frames(self.buf + data if self.buf else data)
        except StreamsError as exc:
            self._goaway(exc.code, str(exc))
        finally:
            self._reading = False
        self.flush()

    def _goaway(self, code: int, why: str) -> None:
        log.info("HTTP/2 connection closed: %s", why)
        self.out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, code)))
        self.flush()
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # --- frames in --------------------------------------------------------------------------
    def _frames(self, buf: bytes) -> None:
        if not self.preface:
            if len(buf) < len(PREFACE):
                self.buf = buf
                return
            if not buf.startswith(PREFACE):
                raise StreamsError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            buf, self.preface = buf[len(PREFACE) :], True
        i, n = 0, len(buf)
        while n - i >= 9 and not self.closed:
            length = buf[i] << 16 | buf[i + 1] << 8 | buf[i + 2]
            if length > DEFAULT_FRAME:
                raise StreamsError(FRAME_SIZE_ERROR, f"a {length}-byte frame")
            if n - i < 9 + length:
                break
            kind, flags = buf[i + 3], buf[i + 4]
            sid = int.from_bytes(buf[i + 5 : i + 9]) & 0x7FFF_FFFF
            self._frame(kind, flags, sid, buf[i + 9 : i + 9 + length])
            i += 9 + length
        self.buf = buf[i:]

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self.headers_open is not None and kind != CONTINUATION:
            raise StreamsError(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._data(sid, flags, payload)
        elif kind == HEADERS:
            self._headers(sid, flags, payload)
        elif kind == CONTINUATION:
            self._continuation(sid, flags, payload)
        elif kind == SETTINGS:
            self._settings(sid, flags, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if sid or len(payload) != 8:
                raise StreamsError(PROTOCOL_ERROR, "a malformed PING")
            if not flags & ACK:
                self.out.append(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            s = self.streams.get(sid)
            if s is not None:
                self._reset(s)
        elif kind == GOAWAY:
            log.debug("the client is going away: %r", payload[:8])  # open streams may finish
        elif kind == PUSH_PROMISE:
            raise StreamsError(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frame types are ignored

    def _unpad(self, flags: int, payload: bytes) -> bytes:
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise StreamsError(PROTOCOL_ERROR, "padding longer than the frame")
            return payload[1 : len(payload) - payload[0]]
        return payload

    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise StreamsError(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        block = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            block = block[5:]
        self.headers_open = (sid, flags, bytearray(block))
        if flags & END_HEADERS:
            self._header_block()

    def _continuation(self, sid: int, flags: int, payload: bytes) -> None:
        if self.headers_open is None or self.headers_open[0] != sid:
            raise StreamsError(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        self.headers_open[2].extend(payload)
        if len(self.headers_open[2]) > MAX_HEADER_LIST:
            raise StreamsError(ENHANCE_YOUR_CALM, "a header block over 64 KiB")
        if flags & END_HEADERS:
            self._header_block()

    def _header_block(self) -> None:
        assert self.headers_open is not None
        sid, flags, block = self.headers_open
        self.headers_open = None
        try:
            headers = [(str(k), str(v)) for k, v in self.decoder.decode(bytes(block), raw=False)]
        except HPACKError as exc:
            why = f"a header block HPACK cannot read: {exc}"
            raise StreamsError(COMPRESSION_ERROR, why) from exc
        s = self.streams.get(sid)
        if s is not None:  # trailers of the client's request: its end
            if flags & END_STREAM and s.handler is not None:
                s.handler.data(s, b"", True)
            return
        if sid <= self.last_stream:  # a stream this side has ended: its late trailers
            return
        self.last_stream = sid
        s = H2Stream(self, sid, headers)
        if len(self.streams) >= self.max_streams:
            self.out.append(frame(RST_STREAM, 0, sid, struct.pack(">I", REFUSED_STREAM)))
            return
        self.streams[sid] = s
        s.handler = self.on_stream(s)
        if s.handler is None:
            self._close(s)
        elif flags & END_STREAM:
            s.handler.data(s, b"", True)

    def _data(self, sid: int, flags: int, payload: bytes) -> None:
        if sid == 0:
            raise StreamsError(PROTOCOL_ERROR, "DATA on stream 0")
        s = self.streams.get(sid)
        size = len(payload)
        # the windows this side granted bound what it holds: past them is the client's fault
        if size > self.recv_window or (s is not None and size > s.room):
            raise StreamsError(FLOW_CONTROL_ERROR, f"{size} bytes of DATA past the window")
        self.recv_window -= size
        if s is not None:
            s.room -= size
        chunk = self._unpad(flags, payload)
        if s is None or s.handler is None:  # a stream ended here: its window goes back at once
            self.recv_unacked += size
            self._grant(None, 0)
            return
        s.recv += size - len(chunk)  # the padding counts against the window, consumed now
        self.recv_unacked += size - len(chunk)
        s.handler.data(s, chunk, bool(flags & END_STREAM))

    def consumed(self, s: H2Stream, n: int) -> None:
        s.recv += n
        self.recv_unacked += n
        self._grant(s, s.recv)

    def _grant(self, s: H2Stream | None, recv: int) -> None:
        if self.recv_unacked >= RECV_WINDOW // 2:
            self.out.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.recv_unacked)))
            self.recv_window += self.recv_unacked
            self.recv_unacked = 0
            self.flush_soon()
        if s is not None and recv >= RECV_WINDOW // 2 and not s.done:
            self.out.append(frame(WINDOW_UPDATE, 0, s.id, struct.pack(">I", recv)))
            s.room += recv
            s.recv = 0
            self.flush_soon()

    def _settings(self, sid: int, flags: int, payload: bytes) -> None:
        if sid:
            raise StreamsError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise StreamsError(FRAME_SIZE_ERROR, "a malformed SETTINGS frame")
        for k in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, k)
            if key == 4:  # INITIAL_WINDOW_SIZE: every open stream's window moves by the change
                if value > MAX_WINDOW:
                    raise StreamsError(FLOW_CONTROL_ERROR, "a window over 2^31-1")
                delta, self.peer_window = value - self.peer_window, value
                for s in self.streams.values():
                    s.window += delta
            elif key == 5:
                if not DEFAULT_FRAME <= value < 1 << 24:
                    raise StreamsError(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
                self.peer_frame = value
        self.out.append(frame(SETTINGS, ACK, 0))
        for s in list(self.streams.values()):
            self.pump(s)

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise StreamsError(FRAME_SIZE_ERROR, "a malformed WINDOW_UPDATE")
        step = int.from_bytes(payload) & 0x7FFF_FFFF
        if sid == 0:
            self.send_window += step
            if self.send_window > MAX_WINDOW:
                raise StreamsError(FLOW_CONTROL_ERROR, "the connection's window overflowed")
            for s in list(self.streams.values()):
                self.pump(s)
            return
        stream = self.streams.get(sid)
        if stream is not None:
            stream.window += step
            self.pump(stream)

    # --- frames out -------------------------------------------------------------------------
    def pump(self, s: H2Stream) -> None:
        """Send what ``s`` has waiting, as far as the windows allow."""
        while s.pending and not s.done:
            data, last = s.pending[0]
            if last:  # the trailers: after the data
                s.pending.popleft()
                if not s.sent:
                    s.sent = True  # a trailers-only response: its block carries the status
                self.out.append(frame(HEADERS, END_HEADERS | END_STREAM, s.id, data))
                self._close(s)
                break
            room = min(s.window, self.send_window, self.peer_frame)
            if room <= 0:
                break
            piece, rest = data[:room], data[room:]
            s.window -= len(piece)
            self.send_window -= len(piece)
            self.out.append(frame(DATA, 0, s.id, piece))
            if rest:
                s.pending[0] = (rest, False)
            else:
                s.pending.popleft()
        self.flush_soon()

    def _close(self, s: H2Stream) -> None:
        s.done = True
        s.pending.clear()
        self.streams.pop(s.id, None)

    def _reset(self, s: H2Stream) -> None:
        handler = s.handler
        self._close(s)
        if handler is not None:
            handler.reset(s)

    def refuse(self, s: H2Stream, code: int = CANCEL) -> None:
        """End ``s`` with RST_STREAM (this side gives up on it)."""
        if not s.done:
            self.out.append(frame(RST_STREAM, 0, s.id, struct.pack(">I", code)))
            self._close(s)
            self.flush_soon()
