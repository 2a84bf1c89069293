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
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from router.epp import GATEWAY_KEY_METADATA, EndpointPicker, ended
from router.eppexchange import Exchange
from router.h2 import H2Connection, H2Stream
from router.h2frames import encode_headers

__all__ = ["ExchangeCall", "GrpcCall", "HealthStates", "serve_native"]

log = logging.getLogger(__name__)

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
RESPONSE_HEADERS = encode_headers([(":status", "200"), ("content-type", "application/grpc")])


OK_TRAILERS = encode_headers([("grpc-status", "0")])


def _status(code: grpc.StatusCode, message: str, headers_sent: bool) -> bytes:
    """The trailers (or, nothing sent yet, a trailers-only response) with gRPC's status."""
    if headers_sent and code is grpc.StatusCode.OK and not message:
        return OK_TRAILERS
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
            message = bytes(buf[5 : 5 + size])
            del buf[: 5 + size]
            self.arrived(message, 5 + size)
            if self.finished:
                return
        if end:
            self.arrived(None, 0)

    def arrived(self, message: bytes | None, size: int) -> None:
        """One message (``size`` bytes of the stream's DATA), or None: the client half-closed.
        Here, queued for :meth:`recv`."""
        self._queue.put_nowait(None if message is None else (message, size))

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
        self.taken(size)
        return message

    def taken(self, size: int) -> None:
        """A message of ``size`` bytes is no longer held here."""
        self.held -= size
        self._grant()

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


class ExchangeCall(GrpcCall):
    """One ext_proc stream. Each message is answered as it arrives, on the connection's own
    turn, where no waiting is needed (:meth:`Exchange.at_once`: the request's headers, the
    response's headers and chunks — most of an exchange); what waits (the route, the finish)
    runs in a task, and what arrives meanwhile is answered after it, in order. Whatever the
    exchange still holds when the stream ends is released before its status is sent."""

    def __init__(
        self, stream: H2Stream, max_message: int, picker: EndpointPicker, calls: OpenCalls
    ) -> None:
        super().__init__(stream, max_message)
        self.picker, self.calls = picker, calls
        self.backlog: deque[tuple[bytes | None, int]] = deque()
        self.ex: Exchange | None = None
        self.ending: tuple[grpc.StatusCode, str] | None = None  # the status, once it ends
        self.refused = picker.refusal(stream.header(GATEWAY_KEY_METADATA))
        self.timer: asyncio.TimerHandle | None = None
        calls.add(self)
        if self.refused is not None:
            # answered once the client's first message is in (discarded unread) or a second
            # has passed: a status overtaking a client's first write makes gRPC's clients
            # report the failed write (INTERNAL) instead of it
            self.timer = asyncio.get_running_loop().call_later(1.0, self._end, *self.refused)
        else:
            self.ex = picker.open()

    def arrived(self, message: bytes | None, size: int) -> None:
        if self.ending is not None:  # the call has ended: what still comes is dropped
            self.taken(size)
        elif self.task is not None or self.backlog:  # after what is being answered
            self.backlog.append((message, size))
        else:
            self._answer(message, size)

    def _answer(self, message: bytes | None, size: int) -> None:
        self.taken(size)
        if self.refused is not None:
            self._end(*self.refused)
            return
        if message is None:  # the client is done: so is the call
            self._end(grpc.StatusCode.OK, "")
            return
        try:
            req = ep.ProcessingRequest.FromString(message)
        except DecodeError:
            self._end(grpc.StatusCode.INVALID_ARGUMENT, "a message that is not ext_proc's")
            return
        assert self.ex is not None
        try:
            out = self.ex.at_once(req)
        except Exception:
            log.exception("the endpoint picker's call failed")
            self._end(grpc.StatusCode.INTERNAL, "kvgate's endpoint picker failed")
            return
        if out is None:
            self._work(self._later(self.ex, req))
        else:
            self._reply(out)

    async def _later(self, ex: Exchange, req: ep.ProcessingRequest) -> None:
        self._reply(await ex.later(req))

    def _reply(self, answers: list[ep.ProcessingResponse]) -> None:
        for resp in answers:
            self.send(resp.SerializeToString())
        if ended(answers):
            self._end(grpc.StatusCode.OK, "")

    def _work(self, work: Coroutine[Any, Any, None]) -> None:
        self.task = asyncio.create_task(work)
        self.calls.tasks.add(self.task)
        self.task.add_done_callback(self._worked)

    def _worked(self, task: asyncio.Task[None]) -> None:
        # (a callback, not the task's own code: a task cancelled before it ever ran has run
        # none of it)
        self.calls.tasks.discard(task)
        self.task = None
        if task.cancelled():
            self._end(grpc.StatusCode.CANCELLED, "cancelled")
        elif (exc := task.exception()) is not None:
            log.error("the endpoint picker's call failed", exc_info=exc)
            self._end(grpc.StatusCode.INTERNAL, "kvgate's endpoint picker failed")
        elif self.ending is not None:
            self._end(*self.ending)
        while self.backlog and self.task is None and self.ending is None:
            self._answer(*self.backlog.popleft())

    def _end(self, code: grpc.StatusCode, message: str) -> None:
        """The call ends with this status: once no task runs, the exchange is released (in a
        task where it holds anything), then the status is sent."""
        if self.ending is None:
            self.ending = (code, message)
            self.backlog.clear()
            if self.timer is not None:
                self.timer.cancel()
        if self.task is not None:
            return  # its end comes back here
        ex, self.ex = self.ex, None
        release = None if ex is None else self.picker.closed(ex)
        if release is not None:  # (its task is never cancelled: ``ending`` is set)
            self._work(release)
            return
        self.finish(*self.ending)
        self.calls.discard(self)

    def reset(self, stream: H2Stream) -> None:
        """The client cancelled the call (or the connection is gone)."""
        self.finished = True
        self.cancel()

    def cancel(self) -> None:
        """End the call now (as CANCELLED where it was still open)."""
        self.fail(grpc.StatusCode.CANCELLED, "cancelled")

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        if self.task is not None and self.ending is None:
            self.task.cancel()
        self._end(code, message)


@dataclass
class OpenCalls:
    """The exchanges open on a server, and the tasks working for them."""

    open: set[ExchangeCall] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    none_open: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, call: ExchangeCall) -> None:
        self.open.add(call)
        self.none_open.clear()

    def discard(self, call: ExchangeCall) -> None:
        self.open.discard(call)
        if not self.open:
            self.none_open.set()


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
    calls: set[asyncio.Task[None]] = set()  # the health service's
    exchanges = OpenCalls()

    def on_stream(stream: H2Stream) -> GrpcCall | None:
        path = stream.header(":path")
        ctype = stream.header("content-type") or ""
        if stream.header(":method") != "POST" or not ctype.startswith("application/grpc"):
            GrpcCall(stream, 0).finish(grpc.StatusCode.INVALID_ARGUMENT, "not a gRPC request")
            return None
        if path == PROCESS:
            return ExchangeCall(stream, max_message, picker, exchanges)
        call = GrpcCall(stream, max_message)
        body: Awaitable[None]
        if path == CHECK:
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
        if exchanges.open:  # they may finish
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(exchanges.none_open.wait(), grace_s)
        for call in list(exchanges.open):
            call.cancel()
        for task in list(calls):
            task.cancel()
        await asyncio.gather(*calls, *exchanges.tasks, return_exceptions=True)
        for conn in connections:
            conn.close()

    return bound, stop, health.set
