"""Property-based fuzzing of the endpoint picker over gRPC, with messages built from Envoy's own
protos (``xds-protos``): random ext_proc exchanges — any processing modes, headers with and
without credentials, bodies that are not JSON or not a request, events out of order, response
events before any request, streams cut anywhere, with and without the gateway's key. The picker
answers each with responses or a typed gRPC status, never an internal error; it stays healthy;
and once the streams are over it holds no reservation. (A stream the picker ended — refused at
the door, or after an immediate response, its last — while the client still wrote can read
INTERNAL "Internal error from Core": gRPC's client-side status for its failed write, not the
picker's.)"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.epp import EppServer, serve_epp
from tests.edgekit import GATEWAY, MODEL, Edge, LoopThread, edge
from tests.eppkit import TRANSPORTS

MODES = [
    processing_mode_pb2.ProcessingMode.NONE,
    processing_mode_pb2.ProcessingMode.STREAMED,
    processing_mode_pb2.ProcessingMode.BUFFERED,
    processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL,
    processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
]
# what a picker may end a stream with: never INTERNAL or UNKNOWN (an exception of its own)
TYPED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.CANCELLED,
}


@pytest.fixture(scope="module", params=TRANSPORTS)
def live(request: pytest.FixtureRequest) -> Iterator[tuple[LoopThread, Edge, EppServer, Any]]:
    lt = LoopThread()
    cm = edge(
        blocks=4000,
        router={"epp_keys": {GATEWAY: "gw"}, "max_body_bytes": 64 << 10},
        admission={"require_api_key": False, "expected_output_cap": 64},
    )
    e = lt.run(cm.__aenter__())

    async def start() -> tuple[EppServer, Any]:
        server = await serve_epp(e.router, "127.0.0.1", 0, request.param)
        return server, grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")

    server, channel = lt.run(start())
    try:
        yield lt, e, server, channel
    finally:
        lt.run(channel.close())
        lt.run(server.stop(0))
        lt.run(cm.__aexit__(None, None, None))
        lt.close()


header_value = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["POST", "/v1/completions", "/v1/chat/completions", "application/json"]),
    st.sampled_from(["Bearer sk-alpha", "Bearer nope", "", "x" * 5000]),
    st.binary(max_size=30).map(lambda b: b.decode("latin-1")),
)
header_names = st.sampled_from(
    [
        ":method",
        ":path",
        ":authority",
        "content-type",
        "authorization",
        "x-request-id",
        "x-gateway-destination-endpoint-subset",
        "content-length",
        "x-anything",
    ]
)


@st.composite
def header_map(draw: st.DrawFn) -> ep.HttpHeaders:
    pairs = draw(st.lists(st.tuples(header_names, header_value), max_size=6))
    if draw(st.booleans()):  # often a plausible request, to get past the first checks
        pairs = [(":method", "POST"), (":path", "/v1/completions"), *pairs]
    return ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=k, raw_value=v.encode("utf-8", "replace"))
                for k, v in pairs
            ]
        ),
        end_of_stream=draw(st.booleans()),
    )


@st.composite
def body(draw: st.DrawFn) -> ep.HttpBody:
    raw = draw(
        st.one_of(
            st.binary(max_size=200),
            st.just(orjson.dumps({"model": MODEL, "prompt": "hello " * 20, "max_tokens": 4})),
            st.just(orjson.dumps({"model": MODEL, "messages": [{"role": "user"}]})),
            st.just(b'{"model": "' + MODEL.encode() + b'", "prompt": ['),
            st.just(b"[" * 2000),
        )
    )
    return ep.HttpBody(body=raw, end_of_stream=draw(st.booleans()))


event = st.one_of(
    header_map().map(lambda h: ep.ProcessingRequest(request_headers=h)),
    body().map(lambda b: ep.ProcessingRequest(request_body=b)),
    st.just(ep.ProcessingRequest(request_trailers=ep.HttpTrailers())),
    header_map().map(lambda h: ep.ProcessingRequest(response_headers=h)),
    body().map(lambda b: ep.ProcessingRequest(response_body=b)),
    st.just(ep.ProcessingRequest(response_trailers=ep.HttpTrailers())),
)


@st.composite
def exchanges(draw: st.DrawFn) -> tuple[str | None, list[ep.ProcessingRequest], bool]:
    key = draw(st.sampled_from([GATEWAY, GATEWAY, GATEWAY, "wrong", None]))
    events = draw(st.lists(event, min_size=0, max_size=8))
    if events and draw(st.booleans()):
        events[0].protocol_config.CopyFrom(
            ep.ProtocolConfiguration(
                request_body_mode=draw(st.sampled_from(MODES)),
                response_body_mode=draw(st.sampled_from(MODES)),
            )
        )
    return key, events, draw(st.booleans())  # cut: cancelled instead of half-closed


async def _exchange(
    channel: Any, key: str | None, events: list[ep.ProcessingRequest], cut: bool
) -> tuple[grpc.StatusCode, str]:
    """The stream's final status as the picker set it (and its details)."""
    stub = ep_grpc.ExternalProcessorStub(channel)
    metadata = (("x-kvgate-gateway-key", key),) if key is not None else ()
    call = stub.Process(metadata=metadata)
    async with asyncio.timeout(10):
        try:
            for req in events:
                await call.write(req)
            if cut:
                call.cancel()
                return grpc.StatusCode.CANCELLED, "cut by the client"
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the picker ended the stream while the client was still writing or reading
        return await call.code(), await call.details()


CODES: Counter[grpc.StatusCode] = Counter()
# the status gRPC's client gives a stream whose write failed because the server had already
# ended it (an exception in the picker reads "Unexpected ..." or "Exception iterating ...")
CLIENT_CORE = "Internal error from Core"


@settings(
    max_examples=int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "250")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ex=exchanges())
def test_no_exchange_makes_the_picker_fail(
    live: tuple[LoopThread, Edge, EppServer, Any],
    ex: tuple[str | None, list[ep.ProcessingRequest], bool],
) -> None:
    lt, _e, _server, channel = live
    code, details = lt.run(_exchange(channel, *ex))
    CODES[code] += 1
    if code == grpc.StatusCode.INTERNAL and details == CLIENT_CORE:
        # the stream ended (refused at the door, or an immediate response, the stream's last)
        # while the client still wrote: the client's own status for its failed write
        return
    assert code in TYPED, (code, details, ex)


def test_after_the_fuzz_the_picker_is_healthy_and_holds_nothing(
    live: tuple[LoopThread, Edge, EppServer, Any],
) -> None:
    lt, e, _server, channel = live

    async def settle() -> tuple[int, int]:
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
        for _ in range(100):
            if await e.reservations() == 0 and not e.router.gate.held:
                break
            await asyncio.sleep(0.1)
        return answer.status, await e.reservations()

    status, held = lt.run(settle())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert held == 0 and not e.router.gate.held
    assert CODES[grpc.StatusCode.OK] > 0  # exchanges got through, not only refused at the door
