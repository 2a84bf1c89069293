"""The endpoint picker on kvgate's own HTTP/2 (router/h2.py) rather than grpcio's server
(``router.epp_transport: native``): the same ext_proc service — router/epp.py's
:class:`EndpointPicker` says who may open a stream, router/eppexchange.py answers each
message — and gRPC's health service (``Check``, ``Watch``), with gRPC's framing (a flag byte and
a length before each message; compressed messages are refused, none is accepted larger than the
router's ``max_body_bytes`` and 1 MiB) and its status in the trailers. grpcio's server costs
about 1.1 ms of CPU per ext_proc exchange on its own; this one a fraction of that
(``docs/benchmarks/proxy.json``, ``bare-epp`` and ``bare-epp-native``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import Awaitable, Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from router.epp import GATEWAY_KEY_METADATA, EndpointPicker
from router.h2 import H2Connection, H2Stream
from router.h2frames import encode_headers

__all__ = ["GrpcCall", "HealthStates", "serve_native"]

log = logging.getLogger(__name__)

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
RESPONSE_HEADERS = encode_headers([(":status", "200"), ("content-type", "application/grpc")])


def _status(code: grpc.StatusCode, message: str, headers_sent: bool) -> bytes:
    """The trailers (or, nothing sent yet, a trailers-only response) with gRPC's status."""
    pairs = [] if headers_sent else [(":status", "200"), ("content-type", "application/grpc")]
    pairs.append(("grpc-status", str(code.value[0])))
    if message:
        pairs.append(("grpc-message", urllib.parse.quote(message, safe=" !#$&'()*+,/:;=?@[]")))
    return encode_headers(pairs)


class GrpcCall:
    """One gRPC call on one HTTP/2 stream: the request's messages in order (``recv``; None once
    the client half-closed), the response's messages (``send``) and its status (``finish``)."""

    def __init__(self, stream: H2Stream, max_message: int) -> None:
        self.stream = stream
        self.max_message = max_message
        self._buf = bytearray()
        self._queue: asyncio.Queue[tuple[bytes, int] | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.finished = False
        # flow control: what came is granted back at once (a message may be larger than a
        # window), while what is held here — queued messages and the one coming — stays
        # within one message and one more window; beyond, the grant waits for ``recv``
        self.held = 0
        self.owed = 0
        self.hold_limit = max_message + (1 << 20)

    # the stream's handler (router/h2.py StreamHandler)
    def data(self, stream: H2Stream, chunk: bytes, end: bool) -> None:
        if self.finished:
            stream.consumed(len(chunk))
            return
        self.held += len(chunk)
        self.owed += len(chunk)
        self._grant()
        buf = self._buf
        buf += chunk
        while len(buf) >= 5:
            size = int.from_bytes(buf[1:5])
            if buf[0]:
                self.fail(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not accepted")
                return
            if size > self.max_message:
                self.fail(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"a message over {self.max_message} bytes"
                )
                return
            if len(buf) < 5 + size:
                break
            self._queue.put_nowait((bytes(buf[5 : 5 + size]), 5 + size))
            del buf[: 5 + size]
        if end:
            self._queue.put_nowait(None)

    def reset(self, stream: H2Stream) -> None:
        """The client cancelled the call (or the connection is gone)."""
        self.finished = True
        if self.task is not None:
            self.task.cancel()

    # the call's side
    async def recv(self) -> bytes | None:
        item = await self._queue.get()
        if item is None:
            return None
        message, size = item
        self.held -= size
        self._grant()
        return message

    def _grant(self) -> None:
        if self.owed and self.held <= self.hold_limit:
            self.stream.consumed(self.owed)
            self.owed = 0

    def send(self, message: bytes) -> None:
        if self.finished:
            return
        if not self.stream.sent:
            self.stream.respond(RESPONSE_HEADERS)
        self.stream.send(b"\x00" + len(message).to_bytes(4) + message)

    def finish(self, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "") -> None:
        if not self.finished:
            self.finished = True
            self.stream.end(_status(code, message, self.stream.sent))

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        self.finish(code, message)
        if self.task is not None:
            self.task.cancel()


class HealthStates:
    """gRPC's health service: a status per service name, and who watches them."""

    def __init__(self) -> None:
        # the server as a whole (the empty name) serves while it listens, as grpcio's says
        self.states: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self.changed = asyncio.Event()

    async def set(self, name: str, state: int) -> None:
        if self.states.get(name) != state:
            self.states[name] = state
            self.changed.set()
            self.changed = asyncio.Event()

    async def check(self, call: GrpcCall) -> None:
        req = health_pb2.HealthCheckRequest.FromString(await call.recv() or b"")
        state = self.states.get(req.service)
        if state is None:
            call.finish(grpc.StatusCode.NOT_FOUND, f"unknown service {req.service!r}")
            return
        call.send(health_pb2.HealthCheckResponse(status=state).SerializeToString())
        call.finish()

    async def watch(self, call: GrpcCall) -> None:
        req = health_pb2.HealthCheckRequest.FromString(await call.recv() or b"")
        last = None
        while True:  # until the client cancels the call
            changed = self.changed
            state = self.states.get(req.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if state != last:
                last = state
                call.send(health_pb2.HealthCheckResponse(status=state).SerializeToString())
            await changed.wait()


async def _process(picker: EndpointPicker, call: GrpcCall) -> None:
    refused = picker.refusal(call.stream.header(GATEWAY_KEY_METADATA))
    if refused is not None:
        # answered once the client's first message is in (discarded unread) or a second has
        # passed: a status overtaking a client's first write makes gRPC's clients report the
        # failed write (INTERNAL) instead of it
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(call.recv(), 1.0)
        call.finish(*refused)
        return
    async with picker.exchange() as ex:
        while (message := await call.recv()) is not None:
            try:
                req = ep.ProcessingRequest.FromString(message)
            except DecodeError:
                call.fail(grpc.StatusCode.INVALID_ARGUMENT, "a message that is not ext_proc's")
                return
            for resp in await ex.on(req):
                call.send(resp.SerializeToString())
    call.finish()


async def _run(call: GrpcCall, body: Awaitable[None]) -> None:
    try:
        await body
    except asyncio.CancelledError:
        call.finish(grpc.StatusCode.CANCELLED, "cancelled")
    except Exception:
        log.exception("the endpoint picker's call failed")
        call.finish(grpc.StatusCode.INTERNAL, "kvgate's endpoint picker failed")
    else:
        call.finish()


async def serve_native(
    picker: EndpointPicker, host: str, port: int
) -> tuple[int, Callable[[float], Awaitable[None]], Callable[[str, int], Awaitable[None]]]:
    """Listen on ``host:port``: the bound port, a stop (its grace: the calls still open may
    finish), and the health service's setter."""
    health = HealthStates()
    settings = picker.parts.settings
    max_message = max(settings.max_body_bytes, 1 << 20) + (64 << 10)
    calls: set[asyncio.Task[None]] = set()

    def on_stream(stream: H2Stream) -> GrpcCall | None:
        call = GrpcCall(stream, max_message)
        path = stream.header(":path")
        ctype = stream.header("content-type") or ""
        if stream.header(":method") != "POST" or not ctype.startswith("application/grpc"):
            call.finish(grpc.StatusCode.INVALID_ARGUMENT, "not a gRPC request")
            return None
        body: Awaitable[None]
        if path == PROCESS:
            body = _process(picker, call)
        elif path == CHECK:
            body = health.check(call)
        elif path == WATCH:
            body = health.watch(call)
        else:
            call.finish(grpc.StatusCode.UNIMPLEMENTED, f"no method {path}")
            return None
        call.task = asyncio.create_task(_run(call, body))
        calls.add(call.task)
        call.task.add_done_callback(calls.discard)
        return call

    connections: list[H2Connection] = []

    def connection() -> H2Connection:
        # past epp_max_streams the picker answers RESOURCE_EXHAUSTED itself (as on grpcio);
        # HTTP/2 refuses a stream only well beyond
        conn = H2Connection(on_stream, settings.epp_max_streams + 64)
        connections[:] = [c for c in connections if not c.closed]
        connections.append(conn)
        return conn

    loop = asyncio.get_running_loop()
    server = await loop.create_server(connection, host, port)
    bound = int(server.sockets[0].getsockname()[1])

    async def stop(grace_s: float) -> None:
        server.close()
        if calls:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), grace_s)
        for task in list(calls):
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        for conn in connections:
            conn.close()

    return bound, stop, health.set
