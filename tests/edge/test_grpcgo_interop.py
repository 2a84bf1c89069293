"""The endpoint picker on kvgate's own HTTP/2 (``router.epp_transport: native``) against gRPC's
Go implementation: grpc-go's own HTTP/2 transport, HPACK encoder (dynamic table, Huffman) and
flow control (its windows sized by bandwidth-delay probes), as Go gateways and Envoy's Go
control planes speak it. tests/interop/grpcgo is a small client on it, built here with the
machine's ``go`` (deploy/setup.sh installs it): health checks; many ext_proc streams at once
on one connection, each sent whole before its first answer is read; messages larger than
either side's windows both ways; a stream without the gateway's key."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from router.epp import EppServer, serve_epp
from tests.deploykit import go_build
from tests.edgekit import GATEWAY, Edge, completion, edge
from tests.eppkit import BUFFERED, FULL_DUPLEX, destination, headers, outcomes, request_headers

SOURCE = Path(__file__).parents[1] / "interop" / "grpcgo"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The client, built from tests/interop/grpcgo (its modules as go.sum pins them)."""
    return go_build(SOURCE, tmp_path_factory.mktemp("grpcgo") / "grpcgo")


async def _run(client: Path, port: int, *args: str, plan: Any = None) -> Any:
    proc = await asyncio.create_subprocess_exec(
        str(client),
        "-addr",
        f"127.0.0.1:{port}",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(
        proc.communicate(orjson.dumps(plan) if plan is not None else b""), 60
    )
    assert proc.returncode == 0, err.decode(errors="replace")
    return orjson.loads(out)


def _plan(key: str, *streams: list[ep.ProcessingRequest]) -> dict[str, Any]:
    return {
        "key": key,
        "streams": [[base64.b64encode(m.SerializeToString()).decode() for m in s] for s in streams],
    }


def _answers(stream: dict[str, Any]) -> list[ep.ProcessingResponse]:
    return [ep.ProcessingResponse.FromString(base64.b64decode(a)) for a in stream["answers"]]


def _first(message: ep.ProcessingRequest, request_mode: int, response_mode: int) -> None:
    message.protocol_config.request_body_mode = request_mode
    message.protocol_config.response_body_mode = response_mode


def _exchange(i: int) -> list[ep.ProcessingRequest]:
    """A buffered request and its whole answer, as one stream sends them."""
    first = ep.ProcessingRequest(request_headers=request_headers())
    _first(first, BUFFERED, BUFFERED)
    body = orjson.dumps(completion(f"stream {i} " * 30, max_tokens=4))
    answer = orjson.dumps(
        {"choices": [{"text": "a b c d"}], "usage": {"prompt_tokens": 90, "completion_tokens": 4}}
    )
    return [
        first,
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
        ep.ProcessingRequest(response_headers=headers((":status", "200"))),
        ep.ProcessingRequest(response_body=ep.HttpBody(body=answer, end_of_stream=True)),
    ]


async def _native(e: Edge) -> EppServer:
    return await serve_epp(e.router, "127.0.0.1", 0, "native")


async def test_grpc_go_checks_health(client: Path) -> None:
    async with edge(router={"epp_keys": {GATEWAY: "gw"}}) as e:
        server = await _native(e)
        try:
            live = await _run(client, server.port, "-health", "liveness")
            assert live == {"code": 0, "status": "SERVING"}
            unknown = await _run(client, server.port, "-health", "no-such-service")
            assert unknown["code"] == 5  # NOT_FOUND
        finally:
            await server.stop(0)


async def test_grpc_go_runs_many_exchanges_on_one_connection(client: Path) -> None:
    async with edge(router={"epp_keys": {GATEWAY: "gw"}}) as e:
        server = await _native(e)
        try:
            n = 48
            result = await _run(
                client, server.port, plan=_plan(GATEWAY, *(_exchange(i) for i in range(n)))
            )
            engines = {u.removeprefix("http://") for u in e.engines.values()}
            for stream in result["streams"]:
                assert stream["code"] == 0, stream
                answers = _answers(stream)
                assert [a.WhichOneof("response") for a in answers] == [
                    "request_headers",
                    "request_body",
                    "response_headers",
                    "response_body",
                ]
                assert destination(answers[1], "request_body") in engines
            assert await e.reservations() == 0
            done = outcomes(e)
            assert len(done) == n and {o.status for o in done} == {"ok"}
            assert {o.output_tokens for o in done} == {4}

            unkeyed = await _run(client, server.port, plan=_plan("", _exchange(n)))
            (refused,) = unkeyed["streams"]
            assert refused["code"] == 16 and refused["answers"] == []  # UNAUTHENTICATED
            assert "gateway key" in refused["message"]
        finally:
            await server.stop(0)


async def test_grpc_go_streams_messages_past_the_windows_both_ways(client: Path) -> None:
    """Response chunks of 1 MiB and more (HTTP/2's initial window is 64 KiB) through a
    full-duplex exchange: each comes in over several window grants and goes back, unchanged,
    as fast as the client's windows let it."""
    async with edge(router={"epp_keys": {GATEWAY: "gw"}}) as e:
        server = await _native(e)
        try:
            first = ep.ProcessingRequest(request_headers=request_headers())
            _first(first, FULL_DUPLEX, FULL_DUPLEX)
            body = orjson.dumps(completion("large " * 30, stream=True, max_tokens=4))
            chunks = [bytes([65 + i]) * ((1 << 20) + 7919 * i) for i in range(3)]
            messages = [
                first,
                ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
                ep.ProcessingRequest(response_headers=headers((":status", "200"))),
                *(
                    ep.ProcessingRequest(
                        response_body=ep.HttpBody(body=c, end_of_stream=i == len(chunks) - 1)
                    )
                    for i, c in enumerate(chunks)
                ),
            ]
            result = await _run(client, server.port, plan=_plan(GATEWAY, messages, messages))
            for stream in result["streams"]:
                assert stream["code"] == 0, stream
                answers = _answers(stream)
                kinds = [a.WhichOneof("response") for a in answers]
                assert kinds == ["request_headers", "request_body", "response_headers"] + [
                    "response_body"
                ] * len(chunks)
                echoed = [
                    a.response_body.response.body_mutation.streamed_response.body
                    for a in answers[3:]
                ]
                assert echoed == chunks
            assert await e.reservations() == 0
        finally:
            await server.stop(0)
