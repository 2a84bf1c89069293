"""Requests through kvgate's endpoint picker as Envoy sends them (a client built from Envoy's
ext_proc protos), for the proxy benchmark's ``kvgate-epp`` target.

One request is one ext_proc stream: the request headers, the whole body (buffered, as the
gateway API's inference extension sends it), the pick; then the request goes to the picked
engine directly (as Envoy would forward it) and its answer flows back through the stream as
Envoy streams it — the response headers, each body chunk as it arrives (the first token, the
end of the stream) — each answered by the picker.
"""

from __future__ import annotations

import time
from collections import Counter

import aiohttp
import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from router.epp import DESTINATION

__all__ = ["EppClient"]

_BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
_STREAMED = processing_mode_pb2.ProcessingMode.STREAMED


def _headers(*pairs: tuple[str, str], end: bool = False) -> ep.HttpHeaders:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=end)


class EppClient:
    """Streams to the pickers at ``host:port`` addresses (one channel each, opened on first
    use), with the gateway key the routers were started with."""

    def __init__(self, key: str, model: str) -> None:
        self.key, self.model = key, model
        self._stubs: dict[str, ep_grpc.ExternalProcessorStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self.errors: Counter[str] = Counter()  # why requests failed, by reason

    def _stub(self, address: str) -> ep_grpc.ExternalProcessorStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address)
            self._channels.append(channel)
            stub = self._stubs[address] = ep_grpc.ExternalProcessorStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def send(self, http: aiohttp.ClientSession, address: str, i: int) -> float | None:
        """One short streamed completion through the picker; its TTFT, None when it failed."""
        started = time.perf_counter()
        call = self._stub(address).Process(metadata=(("x-kvgate-gateway-key", self.key),))
        try:
            first = ep.ProcessingRequest(
                request_headers=_headers(
                    (":method", "POST"),
                    (":path", "/v1/completions"),
                    ("content-type", "application/json"),
                )
            )
            first.protocol_config.request_body_mode = _BUFFERED
            first.protocol_config.response_body_mode = _STREAMED
            await call.write(first)
            await call.read()
            body = orjson.dumps(
                {
                    "model": self.model,
                    "prompt": f"request {i}: say hello",
                    "max_tokens": 4,
                    "stream": True,
                }
            )
            await call.write(
                ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
            )
            picked = await call.read()
            if picked.HasField("immediate_response"):
                refused = picked.immediate_response
                reason = orjson.loads(refused.body or b"{}").get("error", {}).get("type", "")
                self.errors[f"refused {refused.status.code} {reason}"] += 1
                call.cancel()  # as Envoy's filter ends the stream
                return None
            answer = picked.request_body.response
            dest = {
                h.header.key: h.header.raw_value.decode()
                for h in answer.header_mutation.set_headers
            }.get(DESTINATION, "").split(",")[0]  # the pick; its fallbacks follow it
            if not dest:
                self.errors["no destination"] += 1
                return None
            sent = answer.body_mutation.body or body
            ttft = None
            async with http.post(
                f"http://{dest}/v1/completions",
                data=sent,
                headers={"Content-Type": "application/json"},
            ) as r:
                await call.write(
                    ep.ProcessingRequest(response_headers=_headers((":status", str(r.status))))
                )
                await call.read()
                async for chunk in r.content.iter_any():
                    if ttft is None and b"data: {" in chunk:
                        ttft = time.perf_counter() - started
                    await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk)))
                    await call.read()
                await call.write(
                    ep.ProcessingRequest(response_body=ep.HttpBody(end_of_stream=True))
                )
                await call.read()
                ok = r.status == 200
            await call.done_writing()
            if not ok:
                self.errors[f"engine {r.status}"] += 1
            return ttft if ok else None
        except grpc.aio.AioRpcError as exc:
            self.errors[f"grpc {exc.code().name}"] += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.errors[type(exc).__name__] += 1
        call.cancel()
        return None
