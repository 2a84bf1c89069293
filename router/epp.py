"""kvgate as the endpoint picker (EPP) of the Gateway API Inference Extension.

An Envoy ``ext_proc`` gRPC service (``envoy.service.ext_proc.v3.ExternalProcessor``, the protos
of the ``xds-protos`` package). For each HTTP request the gateway streams the request's headers
and body; kvgate runs admission and routing exactly as its HTTP router does (the same intake,
the same gate, the same pipeline and decision record — ``ExternalRequests.route`` of
router/flow/external.py; only among the endpoints the data plane hints at in
``envoy.lb.subset_hint``, when it does) and answers
with the chosen endpoint, as the EPP protocol asks, in the ``x-gateway-destination-endpoint``
header and in the dynamic metadata ``envoy.lb`` → ``x-gateway-destination-endpoint``
(``ip:port``). A refusal becomes an ``ImmediateResponse`` with the router's status (429, 503…),
body and ``Retry-After``. Then it watches the response: headers (status), body chunks (the
first token, reported as it passes; ``usage``), and at the end releases the reservation and
records the outcome (``ExternalRequests.finish``); a stream that ends early (the client went
away, Envoy reset it) is released as cancelled — nothing is left held.

Request bodies must reach the EPP whole before it can pick: ``request_body_mode`` BUFFERED (the
body in one message, answered with the header mutation) or FULL_DUPLEX_STREAMED (chunks, then
the headers answer and the body sent back). Responses may come in any mode; in
FULL_DUPLEX_STREAMED the chunks are sent back unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.eppexchange import EppParts, Exchange
from router.eppwire import DESTINATION, host_port
from router.flow.headers import GATEWAY_KEY_HEADER, match_key
from router.flow.passadmit import PassthroughGate

if TYPE_CHECKING:
    from router.runtime import Router

__all__ = [
    "DESTINATION",
    "GATEWAY_KEY_METADATA",
    "EndpointPicker",
    "EppParts",
    "EppServer",
    "ended",
    "epp_parts",
    "host_port",
    "serve_epp",
]

log = logging.getLogger(__name__)

HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


GATEWAY_KEY_METADATA = GATEWAY_KEY_HEADER.lower()  # on the stream (Envoy: initial_metadata)


class EndpointPicker(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ext_proc service. A stream is the gateway's: with ``router.epp_keys`` set, it
    must carry one in its gRPC metadata (``x-kvgate-gateway-key``, Envoy's ``grpc_service``
    ``initial_metadata``), checked before anything of it is read; at most
    ``router.epp_max_streams`` streams at once. The same on either transport
    (``router.epp_transport``; router/eppnative.py serves it on kvgate's own HTTP/2)."""

    def __init__(self, parts: EppParts) -> None:
        self.parts = parts
        self.streams = 0

    def refusal(self, key: str | bytes | None) -> tuple[grpc.StatusCode, str] | None:
        """Why a stream presenting gateway key ``key`` is not served (None: it is)."""
        keys = self.parts.settings.epp_keys
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")
        if keys and match_key(keys, key) is None:
            why = f"a gateway key is required ({GATEWAY_KEY_METADATA} in the stream's metadata)"
            return grpc.StatusCode.UNAUTHENTICATED, why
        if self.streams >= self.parts.settings.epp_max_streams:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, "too many ext_proc streams"
        return None

    def open(self) -> Exchange:
        """A stream's exchange (counted among the open streams until :meth:`closed`)."""
        self.streams += 1
        return Exchange(self.parts)

    def closed(self, ex: Exchange) -> Coroutine[Any, Any, None] | None:
        """The stream of ``ex`` ended: what releases whatever it still holds (None: nothing)."""
        self.streams -= 1
        return ex.close() if ex.holds() else None

    @contextlib.asynccontextmanager
    async def exchange(self) -> AsyncIterator[Exchange]:
        """One stream's exchange; whatever it still holds when the stream ends is released."""
        ex = self.open()
        try:
            yield ex
        finally:
            release = self.closed(ex)
            if release is not None:
                await asyncio.shield(release)

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        metadata = context.invocation_metadata() or ()
        refused = self.refusal(next((v for k, v in metadata if k == GATEWAY_KEY_METADATA), None))
        if refused is not None:
            # the stream ends with this status, nothing read (an abort raised inside the
            # generator could end it as INTERNAL while the client was still writing)
            context.set_code(refused[0])
            context.set_details(refused[1])
            return
        async with self.exchange() as ex:
            async for req in request_iterator:
                answers = await ex.on(req)
                for resp in answers:
                    yield resp
                if ended(answers):
                    return


def ended(answers: list[ep.ProcessingResponse]) -> bool:
    """Whether these answers end the exchange: an immediate response (a refusal, or an answer
    the picker gives itself) is the stream's last — the data plane sends nothing more on it,
    and the stream ends here even where a client would leave it open."""
    return any(a.HasField("immediate_response") for a in answers)


@dataclass
class EppServer:
    port: int
    _close: Callable[[float], Awaitable[None]]
    _health: asyncio.Task[None]

    async def stop(self, grace_s: float = 5.0) -> None:
        self._health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._health
        await self._close(grace_s)


def epp_parts(router: Router) -> EppParts:
    return EppParts(
        router.settings,
        router.entry,
        router.external,
        router.upstream,
        router.loops,
        router.external.views,
        PassthroughGate(
            router.gate,
            router.external.views,
            router.metrics,
            router.entry.recorder,
            router.settings.block_size,
        ),
    )


async def serve_epp(
    router: Router, host: str, port: int, transport: str | None = None
) -> EppServer:
    """Start ``router``'s EPP and the gRPC health services (``liveness`` always serving;
    ``readiness`` and the ext_proc service while the router is ready) on ``host:port`` (0: any
    free port), on ``transport`` (None: the one ``router.epp_transport`` names)."""
    parts = epp_parts(router)
    if not router.settings.epp_keys:
        log.warning(
            "the endpoint picker asks no gateway key (router.epp_keys is empty): anything "
            "that reaches %s:%s may route requests and hold reservations",
            host,
            port,
        )
    picker = EndpointPicker(parts)
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    if (transport or router.settings.epp_transport) == "native":
        from router.eppnative import serve_native

        bound, close, set_health = await serve_native(picker, host, port)
    else:
        bound, close, set_health = await _serve_grpcio(picker, host, port)
    await set_health("liveness", serving)

    async def follow() -> None:
        while True:
            state = serving if parts.loops.ready(time.time()) else not_serving
            for name in HEALTH_SERVICES[1:]:
                await set_health(name, state)
            await asyncio.sleep(1.0)

    return EppServer(bound, close, asyncio.create_task(follow()))


async def _serve_grpcio(
    picker: EndpointPicker, host: str, port: int
) -> tuple[int, Callable[[float], Awaitable[None]], Callable[[str, int], Awaitable[None]]]:
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return bound, server.stop, checker.set
