"""kvgate's HTTP/2 server connection (router/h2.py) frame by frame: the preface and SETTINGS,
PING, header blocks split over CONTINUATION (HPACK from the ``hpack`` package's own encoder,
Huffman and dynamic table on), flow control of what it sends (the peer's windows and frame
size), RST_STREAM, and the protocol errors that end a connection with GOAWAY."""

from __future__ import annotations

import asyncio
import struct

import pytest
from hpack import Decoder, Encoder

from router.h2 import H2Connection, H2Stream
from router.h2frames import (
    DATA,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    encode_headers,
    frame,
)


class Transport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


class Handler:
    def __init__(self) -> None:
        self.chunks: list[tuple[bytes, bool]] = []
        self.was_reset = False

    def data(self, stream: H2Stream, chunk: bytes, end: bool) -> None:
        self.chunks.append((chunk, end))

    def reset(self, stream: H2Stream) -> None:
        self.was_reset = True


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, i = [], 0
    while i < len(data):
        n = int.from_bytes(data[i : i + 3], "big")
        out.append(
            (
                data[i + 3],
                data[i + 4],
                int.from_bytes(data[i + 5 : i + 9], "big"),
                data[i + 9 : i + 9 + n],
            )
        )
        i += 9 + n
    return out


class Peer:
    """The client's side: its encoder, and a connection with a fake transport."""

    def __init__(self) -> None:
        self.streams: dict[int, H2Stream] = {}
        self.handlers: dict[int, Handler] = {}

        def on_stream(s: H2Stream) -> Handler:
            self.streams[s.id] = s
            self.handlers[s.id] = Handler()
            return self.handlers[s.id]

        self.conn = H2Connection(on_stream)
        self.transport = Transport()
        self.conn.connection_made(self.transport)  # type: ignore[arg-type]
        self.encoder = Encoder()
        self.seen = 0

    def send(self, data: bytes) -> None:
        self.conn.data_received(data)

    def out(self) -> list[tuple[int, int, int, bytes]]:
        """The frames written since the last call."""
        new = bytes(self.transport.written[self.seen :])
        self.seen = len(self.transport.written)
        return frames(new)

    def open(self, sid: int, end: bool = False) -> None:
        block = self.encoder.encode(
            [(":method", "POST"), (":path", "/x"), ("content-type", "application/grpc")]
        )
        self.send(frame(HEADERS, 0x4 | (0x1 if end else 0), sid, block))


async def test_preface_settings_and_ping() -> None:
    p = Peer()
    first = p.out()
    assert [f[0] for f in first] == [SETTINGS, WINDOW_UPDATE]  # its own, at once
    p.send(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 100)))
    p.send(frame(PING, 0, 0, b"12345678"))
    await asyncio.sleep(0)
    got = p.out()
    assert (SETTINGS, 0x1, 0, b"") in got  # acknowledged
    assert (PING, 0x1, 0, b"12345678") in got
    assert p.conn.peer_window == 100


async def test_a_header_block_over_continuation_frames_opens_a_stream() -> None:
    p = Peer()
    p.send(PREFACE + frame(SETTINGS, 0, 0))
    block = p.encoder.encode(
        [(":method", "POST"), (":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
         ("x-kvgate-gateway-key", "k" * 300)]
    )  # fmt: skip
    p.send(frame(HEADERS, 0, 1, block[:10]) + frame(9, 0, 1, block[10:40]))
    assert not p.streams
    p.send(frame(9, 0x4, 1, block[40:]))
    s = p.streams[1]
    assert s.header(":path") == "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    assert s.header("x-kvgate-gateway-key") == "k" * 300
    # the table the encoder filled is the decoder's too: a second block indexes into it
    p.open(3)
    assert p.streams[3].header(":method") == "POST"
    p.send(frame(DATA, 0x1, 1, b"abc"))
    assert p.handlers[1].chunks == [(b"abc", True)]


async def test_what_it_sends_waits_for_the_peers_windows_and_frame_size() -> None:
    p = Peer()
    p.send(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 10)))  # 10-byte stream windows
    p.open(1)
    s = p.streams[1]
    p.out()
    s.send(b"x" * 100)
    await asyncio.sleep(0)
    sent = [f for f in p.out() if f[0] == DATA]
    assert [len(f[3]) for f in sent] == [10]
    s.end(b"trailers")  # after the data, not before
    p.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 50)))
    await asyncio.sleep(0)
    assert [len(f[3]) for f in p.out() if f[0] == DATA] == [50]
    # a larger window: the rest, in frames no larger than 16 KiB, then the trailers
    p.send(frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 20)))
    p.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
    await asyncio.sleep(0)
    got = p.out()
    assert [len(f[3]) for f in got if f[0] == DATA] == [40]
    assert got[-1][:3] == (HEADERS, 0x5, 1) and got[-1][3] == b"trailers"
    big = Peer()
    big.send(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 20)))
    big.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
    big.open(1)
    big.out()
    big.streams[1].send(b"y" * 40_000)
    await asyncio.sleep(0)
    assert [len(f[3]) for f in big.out() if f[0] == DATA] == [16_384, 16_384, 7_232]


async def test_a_reset_stream_tells_its_handler_and_sends_nothing_more() -> None:
    p = Peer()
    p.send(PREFACE + frame(SETTINGS, 0, 0))
    p.open(1)
    s = p.streams[1]
    p.send(frame(RST_STREAM, 0, 1, struct.pack(">I", 8)))
    assert p.handlers[1].was_reset and s.done
    p.out()
    s.send(b"late")
    await asyncio.sleep(0)
    assert not [f for f in p.out() if f[0] == DATA]
    # data still arriving for it gives its window back to the connection, nothing else
    p.send(frame(DATA, 0, 1, b"z" * 10))
    assert not p.transport.closed


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 1),  # not HTTP/2
        (PREFACE + frame(DATA, 0, 0, b"x"), 1),  # DATA on stream 0
        (PREFACE + b"\x00\x50\x00" + bytes((0, 0)) + (1).to_bytes(4, "big"), 6),  # 20 KiB
        (PREFACE + frame(HEADERS, 0, 2, b""), 1),  # a stream id a client may not use
        (PREFACE + frame(HEADERS, 0x4, 1, b"\xff\xff\xff\xff\xff"), 9),  # HPACK garbage
        (PREFACE + frame(PING, 0, 0, b"short"), 1),
        (PREFACE + frame(5, 0x4, 1, b"\x00\x00\x00\x02"), 1),  # a client's PUSH_PROMISE
    ],
)
async def test_protocol_errors_end_the_connection_with_goaway(data: bytes, code: int) -> None:
    p = Peer()
    p.out()
    p.send(data)
    goaway = [f for f in p.out() if f[0] == GOAWAY]
    assert goaway and struct.unpack(">II", goaway[0][3])[1] == code
    assert p.transport.closed


def test_response_header_blocks_decode_on_any_connection() -> None:
    block = encode_headers([(":status", "200"), ("grpc-status", "0")])
    for _ in range(2):  # the same bytes twice: nothing indexed, the table unchanged
        assert Decoder().decode(block) == [(":status", "200"), ("grpc-status", "0")]
    d = Decoder()
    assert d.decode(block) == d.decode(block)


async def test_data_past_the_granted_windows_ends_the_connection() -> None:
    """What a client sends is bounded by the windows granted: 1 MiB a stream until consumed."""
    p = Peer()
    p.send(PREFACE + frame(SETTINGS, 0, 0))
    p.open(1)
    chunk = b"d" * 16_384
    for _ in range(64):  # exactly the stream's 1 MiB: taken (nothing consumed, nothing granted)
        p.send(frame(DATA, 0, 1, chunk))
    assert not p.transport.closed and p.streams[1].room == 0
    p.out()
    p.send(frame(DATA, 0, 1, b"x"))
    goaway = [f for f in p.out() if f[0] == GOAWAY]
    assert goaway and struct.unpack(">II", goaway[0][3])[1] == 3  # FLOW_CONTROL_ERROR
    assert p.transport.closed


async def test_consuming_grants_the_window_again() -> None:
    p = Peer()
    p.send(PREFACE + frame(SETTINGS, 0, 0))
    p.open(1)
    s = p.streams[1]
    for _ in range(64):
        p.send(frame(DATA, 0, 1, b"d" * 16_384))
    p.out()
    s.consumed(1 << 20)
    await asyncio.sleep(0)
    updates = [f for f in p.out() if f[0] == WINDOW_UPDATE]
    assert {(f[2], struct.unpack(">I", f[3])[0]) for f in updates} == {(0, 1 << 20), (1, 1 << 20)}
    p.send(frame(DATA, 0, 1, b"more"))
    assert not p.transport.closed


async def test_a_connection_without_the_preface_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("router.h2.PREFACE_TIMEOUT_S", 0.01)
    p = Peer()
    p.send(PREFACE[:5])
    await asyncio.sleep(0.05)
    assert p.transport.closed
