"""The endpoint picker's own HTTP/2 (``router.epp_transport: native``, router/h2.py) against
another implementation: nghttp2's client (``nghttp``, the codec Envoy long used), which opens
with its own SETTINGS and PRIORITY frames, sends HEADERS with priority, and checks every frame
it gets. A health check and a whole ext_proc exchange (the request's headers and body in one
stream, the pick back, gRPC's status in the trailers); a stream without the gateway's key is
refused UNAUTHENTICATED."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import orjson
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health_pb2

from router.epp import serve_epp
from tests.edgekit import GATEWAY, MODEL, edge
from tests.eppkit import destination, request_headers

NGHTTP = shutil.which("nghttp")
pytestmark = pytest.mark.skipif(NGHTTP is None, reason="nghttp (nghttp2-client) not installed")


def _framed(*messages: bytes) -> bytes:
    return b"".join(b"\x00" + len(m).to_bytes(4, "big") + m for m in messages)


def _messages(body: bytes) -> list[bytes]:
    out, i = [], 0
    while i + 5 <= len(body):
        size = int.from_bytes(body[i + 1 : i + 5], "big")
        out.append(body[i + 5 : i + 5 + size])
        i += 5 + size
    assert i == len(body), "a truncated gRPC message"
    return out


async def _nghttp(
    port: int, path: str, body: bytes, tmp: Path, *extra: str, verbose: bool = False
) -> tuple[int, bytes]:
    data = tmp / "request.bin"
    data.write_bytes(body)
    args = ["-H", "content-type: application/grpc", "-H", "te: trailers", *extra]
    proc = await asyncio.create_subprocess_exec(
        str(NGHTTP),
        *(["-v"] if verbose else []),
        "-d",
        str(data),
        *args,
        f"http://127.0.0.1:{port}{path}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err.decode(errors="replace")
    return proc.returncode, out


async def test_nghttp2_checks_health_and_runs_an_exchange_on_the_native_picker(
    tmp_path: Path,
) -> None:
    async with edge(router={"epp_keys": {GATEWAY: "gw"}}) as e:
        server = await serve_epp(e.router, "127.0.0.1", 0, "native")
        try:
            check = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
            _, out = await _nghttp(
                server.port, "/grpc.health.v1.Health/Check", _framed(check), tmp_path
            )
            (answer,) = _messages(out)
            assert health_pb2.HealthCheckResponse.FromString(answer).status == (
                health_pb2.HealthCheckResponse.SERVING
            )

            mode = processing_mode_pb2.ProcessingMode
            first = ep.ProcessingRequest(request_headers=request_headers())
            first.protocol_config.request_body_mode = mode.BUFFERED
            body = orjson.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 4})
            second = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
            exchange = _framed(first.SerializeToString(), second.SerializeToString())
            key = f"x-kvgate-gateway-key: {GATEWAY}"
            path = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
            _, out = await _nghttp(server.port, path, exchange, tmp_path, "-H", key)
            answers = [ep.ProcessingResponse.FromString(m) for m in _messages(out)]
            assert [a.WhichOneof("response") for a in answers] == [
                "request_headers",
                "request_body",
            ]
            picked = destination(answers[1], "request_body")
            assert picked in {u.removeprefix("http://") for u in e.engines.values()}
            # the stream ended without the response: nothing stays held
            await asyncio.sleep(0.2)
            assert await e.reservations() == 0

            _, trace = await _nghttp(
                server.port, path, exchange, tmp_path, verbose=True
            )  # no gateway key
            text = trace.decode(errors="replace")
            assert "grpc-status: 16" in text, text[-2000:]
            assert "recv GOAWAY" not in text and "RST_STREAM" not in text
        finally:
            await server.stop(0)
