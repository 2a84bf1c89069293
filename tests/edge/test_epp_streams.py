"""The picker's streams as a whole, on each of its gRPC servers: messages that come before the
answers to earlier ones are answered in order; a stream reset while its request is being routed,
and one still open when the picker stops, leave nothing held."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from tests import eppkit
from tests.conftest import wait_until
from tests.edgekit import Edge, completion
from tests.eppkit import (
    BUFFERED,
    TRANSPORTS,
    Envoy,
    destination,
    headers,
    on_transport,
    outcomes,
    picker_on,
    request_headers,
    upstream,
)

TENANTS = {"sk-alpha": {"name": "alpha", "priority": "normal"}}


@pytest.fixture(autouse=True, params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(eppkit, "start_picker", on_transport(request.param))
    return str(request.param)


@pytest.fixture
async def picker() -> AsyncIterator[tuple[Edge, Any, Any]]:
    async with picker_on(admission={"tenants": TENANTS}) as p:
        yield p


async def test_messages_sent_ahead_are_answered_in_order(
    picker: tuple[Edge, Any, Any],
) -> None:
    """A data plane that does not wait for each answer (Envoy's streamed modes): what comes
    while the request is being routed is answered after the pick, each in its turn."""
    e, channel, _ = picker
    envoy = Envoy(ep_grpc.ExternalProcessorStub(channel), BUFFERED, BUFFERED)
    body = orjson.dumps(completion("ahead " * 40, max_tokens=4))
    answer = orjson.dumps(
        {"choices": [{"text": "a b c d"}], "usage": {"prompt_tokens": 80, "completion_tokens": 4}}
    )
    await envoy.send(request_headers=request_headers())
    await envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
    await envoy.send(response_headers=headers((":status", "200")))
    await envoy.send(response_body=ep.HttpBody(body=answer[:10]))
    await envoy.send(response_body=ep.HttpBody(body=answer[10:], end_of_stream=True))
    await envoy.call.done_writing()
    kinds = []
    while (resp := await envoy.call.read()) is not grpc.aio.EOF:
        kinds.append(resp.WhichOneof("response"))
        if kinds[-1] == "request_body":
            assert destination(resp, "request_body")
    assert kinds == [
        "request_headers",
        "request_body",
        "response_headers",
        "response_body",
        "response_body",
    ]
    assert await envoy.call.code() == grpc.StatusCode.OK
    assert await e.reservations() == 0  # released before the stream's status
    (out,) = outcomes(e)
    assert out.status == "ok" and out.output_tokens == 4


async def test_a_stream_reset_while_routing_leaves_nothing_held() -> None:
    """Reset before its route has begun, during it, after it: each stream's reservation is
    released and the stream no longer counts against ``router.epp_max_streams``."""
    async with picker_on(admission={"tenants": TENANTS}, router={"epp_max_streams": 2}) as p:
        e, channel, _ = p
        stub = ep_grpc.ExternalProcessorStub(channel)
        for i in range(12):
            envoy = Envoy(stub, BUFFERED, BUFFERED)
            await envoy.send(request_headers=request_headers())
            body = orjson.dumps(completion(f"reset {i} " * 40))
            await envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
            if i % 3 == 1:
                await asyncio.sleep(0)
            elif i % 3 == 2:
                await envoy.read()
            envoy.call.cancel()
        await _settled(e)
        for _ in range(3):  # the streams reset are not counted open any more
            envoy = Envoy(stub, BUFFERED, BUFFERED)
            await envoy.send(request_headers=request_headers())
            assert (await envoy.read()).HasField("request_headers")
            await envoy.call.done_writing()
            assert await envoy.call.code() == grpc.StatusCode.OK


async def _settled(e: Edge) -> None:

    async def settled() -> bool:
        return len(outcomes(e)) == len(e.decisions()) and await e.reservations() == 0

    await wait_until(settled, 10, "every routed request released and its outcome recorded")
    assert {o.status for o in outcomes(e)} <= {"cancelled"}


async def test_a_stream_open_when_the_picker_stops_is_released(transport: str) -> None:
    async with picker_on(admission={"tenants": TENANTS}) as (e, channel, server):
        envoy = Envoy(ep_grpc.ExternalProcessorStub(channel), BUFFERED, BUFFERED)
        await envoy.send(request_headers=request_headers())
        await envoy.read()
        await envoy.send(
            request_body=ep.HttpBody(body=orjson.dumps(completion()), end_of_stream=True)
        )
        picked = await envoy.read()
        status, _ = await upstream(
            destination(picked, "request_body"),
            "/v1/completions",
            picked.request_body.response.body_mutation.body,
        )
        assert status == 200 and await e.reservations() == 1
        await server.stop(0.2)  # the stream does not finish within the grace

        async def released() -> bool:
            return await e.reservations() == 0 and len(outcomes(e)) == 1

        await wait_until(released, 5, "the open stream's reservation released")
        assert [o.status for o in outcomes(e)] == ["cancelled"]
        # (grpcio's server ends its streams as UNAVAILABLE)
        code = await envoy.call.code()
        assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


async def test_an_immediate_response_ends_the_stream(picker: tuple[Edge, Any, Any]) -> None:
    """Refused (or answered by the picker itself), the stream is over: it ends with OK even
    where the client would leave it open, and counts no more against the picker's streams."""
    e, channel, _ = picker
    stub = ep_grpc.ExternalProcessorStub(channel)
    envoy = Envoy(stub, BUFFERED, BUFFERED)
    await envoy.send(request_headers=request_headers("sk-nobody"))
    assert (await envoy.read()).immediate_response.status.code == 401
    assert await envoy.call.read() is grpc.aio.EOF
    assert await envoy.call.code() == grpc.StatusCode.OK
    models = Envoy(stub, BUFFERED, BUFFERED)
    await models.send(
        request_headers=headers((":method", "GET"), (":path", "/v1/models"), end=True)
    )
    assert (await models.read()).immediate_response.status.code == 200
    assert await models.call.code() == grpc.StatusCode.OK
    assert await e.reservations() == 0
