"""Playing Envoy against kvgate's endpoint picker: the ext_proc exchange as Envoy's filter
drives it, on a gRPC client built from Envoy's own protos (``xds-protos``), and a picker in front
of an edge router (tests/edgekit.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import json_format

from router.epp import DESTINATION, EppServer, serve_epp
from streams.codec import decode
from streams.schemas import Outcome
from streams.topics import OUTCOMES
from tests.edgekit import GATEWAY, Edge, edge

BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
start_picker: Any = serve_epp  # what picker_on starts the picker with (tests: on_transport)
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def headers(*pairs: tuple[str, str], end: bool = False) -> ep.HttpHeaders:
    return ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
        ),
        end_of_stream=end,
    )


def request_headers(key: str = "sk-alpha", path: str = "/v1/completions") -> ep.HttpHeaders:
    return headers(
        (":method", "POST"),
        (":path", path),
        (":authority", "gateway"),
        ("content-type", "application/json"),
        ("authorization", f"Bearer {key}"),
    )


class Envoy:
    """One ext_proc stream, driven as Envoy's ext_proc filter drives it."""

    def __init__(
        self,
        stub: Any,
        request_mode: int,
        response_mode: int,
        metadata: tuple[tuple[str, str], ...] = (("x-kvgate-gateway-key", GATEWAY),),
    ) -> None:
        self.call = stub.Process(metadata=metadata)
        self.config = ep.ProtocolConfiguration(
            request_body_mode=request_mode, response_body_mode=response_mode
        )
        self.first = True

    async def send(self, **kind: Any) -> None:
        req = ep.ProcessingRequest(**kind)
        if self.first:
            req.protocol_config.CopyFrom(self.config)
            self.first = False
        await self.call.write(req)

    async def read(self) -> ep.ProcessingResponse:
        resp = await asyncio.wait_for(self.call.read(), 10)
        assert resp is not grpc.aio.EOF
        return resp

    async def served(self, by: str, answer: bytes, key: str = f"{DESTINATION}-served") -> None:
        """The engine at ``by`` answered ``answer`` (JSON, whole): the response through the
        processor, with the endpoint that served named as the data plane names it
        (``envoy.lb`` → ``key``); the stream ends."""
        meta = base_pb2.Metadata()
        meta.filter_metadata["envoy.lb"].update({key: by})
        await self.send(
            response_headers=headers((":status", "200"), ("content-type", "application/json")),
            metadata_context=meta,
        )
        await self.read()
        await self.send(response_body=ep.HttpBody(body=answer, end_of_stream=True))
        await self.read()
        await self.call.done_writing()


def endpoints(resp: ep.ProcessingResponse, field: str) -> list[str]:
    """The endpoints named, the pick first and its fallbacks after it (no repeats)."""
    common = getattr(resp, field).response
    set_headers = {
        h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
    }
    meta = json_format.MessageToDict(resp.dynamic_metadata)
    assert meta["envoy.lb"][DESTINATION] == set_headers[DESTINATION]  # the same in both
    listed = set_headers[DESTINATION].split(",")
    assert len(set(listed)) == len(listed)
    return listed


def destination(resp: ep.ProcessingResponse, field: str) -> str:
    """The endpoint picked (the first named)."""
    return endpoints(resp, field)[0]


def outcomes(e: Edge) -> list[Outcome]:
    return [decode(Outcome, v) for v in e.published(OUTCOMES.suffix)]


async def upstream(dest: str, path: str, body: bytes) -> tuple[int, list[bytes]]:
    """What Envoy does with the picked endpoint: send the request there."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"http://{dest}{path}", data=body, headers={"Content-Type": "application/json"}
        ) as r,
    ):
        return r.status, [chunk async for chunk in r.content.iter_any()]


TRANSPORTS = ("grpcio", "native")  # the picker's gRPC servers (router.epp_transport)


def on_transport(transport: str) -> Any:
    """``serve_epp`` on ``transport`` (tests run the picker's tests on each)."""
    from router import epp

    async def serve(router: Any, host: str, port: int) -> EppServer:
        return await epp.serve_epp(router, host, port, transport)

    return serve


@contextlib.asynccontextmanager
async def picker_on(
    admission: dict[str, Any] | None = None, router: dict[str, Any] | None = None, **kw: Any
) -> AsyncIterator[tuple[Edge, Any, EppServer]]:
    """An edge router with its endpoint picker serving (the gateway's key: ``GATEWAY``), and a
    channel to it."""
    settings = {"epp_keys": {GATEWAY: "gw-a"}, **(router or {})}
    async with edge(admission=admission, router=settings, **kw) as e:
        server = await start_picker(e.router, "127.0.0.1", 0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            yield e, channel, server
        finally:
            await channel.close()
            await server.stop(0)
