"""HTTP/2's wire vocabulary for router/h2.py (RFC 9113): frame and flag types, error codes,
the limits this server keeps, a frame's bytes, and header blocks that need no table."""

from __future__ import annotations

from hpack import Encoder
from hpack.struct import NeverIndexedHeaderTuple

__all__ = [
    "ACK", "CANCEL", "COMPRESSION_ERROR", "CONTINUATION", "DATA", "DEFAULT_FRAME",
    "DEFAULT_WINDOW", "END_HEADERS", "END_STREAM", "ENHANCE_YOUR_CALM", "FLOW_CONTROL_ERROR",
    "FRAME_SIZE_ERROR", "GOAWAY", "HEADERS", "MAX_HEADER_LIST", "MAX_WINDOW", "PADDED", "PING",
    "PREFACE", "PRIORITY", "PRIORITY_FLAG", "PROTOCOL_ERROR", "PUSH_PROMISE", "RECV_WINDOW",
    "REFUSED_STREAM", "RST_STREAM", "SETTINGS", "WINDOW_UPDATE", "StreamsError",
    "encode_headers", "frame",
]  # fmt: skip

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 1, 3, 6, 7, 8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 9, 11
DEFAULT_WINDOW, DEFAULT_FRAME = 65_535, 16_384
MAX_WINDOW = (1 << 31) - 1
RECV_WINDOW = 1 << 20  # what a stream (and the connection, per stream) may send unconsumed
MAX_HEADER_LIST = 64 << 10


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 255, n & 255, kind, flags)) + stream.to_bytes(4) + payload


def encode_headers(headers: list[tuple[str, str]]) -> bytes:
    """A header block that leaves the peer's dynamic table as it was (literals never indexed):
    the same bytes are valid on any connection, at any time."""
    return Encoder().encode([NeverIndexedHeaderTuple(k, v) for k, v in headers], huffman=False)


class StreamsError(Exception):
    """A connection error (RFC 9113 §5.4.1): GOAWAY with ``code``, the connection closed."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code
