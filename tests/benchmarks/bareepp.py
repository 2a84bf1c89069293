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

    def answer(self, req: ep.ProcessingRequest) -> ep.ProcessingResponse | None:
        kind = req.WhichOneof("request")
        if kind == "request_body":
            if not req.request_body.end_of_stream:
                return None
            dest = next(self._turn)
            mutation = ep.HeaderMutation(set_headers=[set_header(DESTINATION, dest)])
            return ep.ProcessingResponse(
                request_body=ep.BodyResponse(response=ep.CommonResponse(header_mutation=mutation)),
                dynamic_metadata=destination(dest),
            )
        if kind == "request_headers":
            return ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        if kind == "response_headers":
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        if kind == "response_body":
            return ep.ProcessingResponse(response_body=ep.BodyResponse())
        if kind == "response_trailers":
            return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        return None

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        async for req in request_iterator:
            resp = self.answer(req)
            if resp is not None:
                yield resp


async def serve_native(port: int, engines: list[str]) -> None:
    """The same answers on kvgate's own HTTP/2 (router/h2.py, router/eppnative.py's framing),
    each as its message arrives (as kvgate's picker answers those that need no waiting)."""
    from router.eppnative import GrpcCall
    from router.h2 import H2Connection, H2Stream

    picker = BarePicker(engines)

    class BareCall(GrpcCall):
        def arrived(self, message: bytes | None, size: int) -> None:
            self.taken(size)
            if message is None:
                self.finish()
                return
            resp = picker.answer(ep.ProcessingRequest.FromString(message))
            if resp is not None:
                self.send(resp.SerializeToString())

    def on_stream(stream: H2Stream) -> GrpcCall:
        return BareCall(stream, 1 << 22)

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
