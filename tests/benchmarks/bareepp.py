"""The floor an endpoint picker in Python can reach: an ext_proc server on gRPC's asyncio API
(grpcio, the library kvgate's picker runs on, on uvloop as kvgate's router) that does nothing
a picker does beyond answering every message of the exchange.

    python -m tests.benchmarks.bareepp [--native] --port P HOST:PORT [HOST:PORT ...]

It answers the request headers, then the body with the next engine (round-robin) as the
destination (header and ``envoy.lb`` metadata, the EPP protocol's), then each response message
Envoy streams back (the response headers, every body chunk, the end of the stream) with an
empty answer — no parsing, authentication, admission, routing or recording. The proxy benchmark
(:mod:`tests.benchmarks.proxy`, target ``bare-epp``) measures kvgate's picker against it with the
same client, the way ``bare`` measures kvgate's HTTP path.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from router.eppwire import DESTINATION, destination, set_header

__all__ = ["BarePicker"]


class BarePicker(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, engines: list[str]) -> None:
        self._turn = itertools.cycle(engines)

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        async for req in request_iterator:
            kind = req.WhichOneof("request")
            if kind == "request_body":
                if not req.request_body.end_of_stream:
                    continue
                dest = next(self._turn)
                mutation = ep.HeaderMutation(set_headers=[set_header(DESTINATION, dest)])
                yield ep.ProcessingResponse(
                    request_body=ep.BodyResponse(
                        response=ep.CommonResponse(header_mutation=mutation)
                    ),
                    dynamic_metadata=destination(dest),
                )
            elif kind == "request_headers":
                yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
            elif kind == "response_headers":
                yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
            elif kind == "response_body":
                yield ep.ProcessingResponse(response_body=ep.BodyResponse())
            elif kind == "response_trailers":
                yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


async def serve_native(port: int, engines: list[str]) -> None:
    """The same answers on kvgate's own HTTP/2 (router/h2.py, router/eppnative.py's framing)."""
    from router.eppnative import GrpcCall
    from router.h2 import H2Connection, H2Stream

    picker = BarePicker(engines)

    def on_stream(stream: H2Stream) -> GrpcCall:
        call = GrpcCall(stream, 1 << 22)

        async def requests() -> AsyncIterator[ep.ProcessingRequest]:
            while (message := await call.recv()) is not None:
                yield ep.ProcessingRequest.FromString(message)

        async def run() -> None:
            async for resp in picker.Process(requests(), None):
                call.send(resp.SerializeToString())
            call.finish()

        call.task = asyncio.create_task(run())
        return call

    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: H2Connection(on_stream), "127.0.0.1", port)
    await server.serve_forever()


async def serve(port: int, engines: list[str]) -> None:
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(BarePicker(engines), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def cli() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--native", action="store_true", help="on kvgate's own HTTP/2")
    ap.add_argument("engines", nargs="+", help="host:port of each engine")
    args = ap.parse_args()
    from router.serve import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory("auto")) as runner:
        runner.run((serve_native if args.native else serve)(args.port, args.engines))


if __name__ == "__main__":
    cli()
