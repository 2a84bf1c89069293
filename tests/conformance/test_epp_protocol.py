"""The Endpoint Picker Protocol (Gateway API Inference Extension, proposal 004, v1.0.0), one
test per requirement (tests/conformance/README.md maps them). The picker is the ``picker``
fixture's (tests/conformance/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conformance.conftest import Target
from tests.edgekit import MODEL
from tests.eppkit import BUFFERED, FULL_DUPLEX, Envoy, headers, upstream

HEADER = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
IP_PORT = re.compile(r"^\d{1,3}(\.\d{1,3}){3}:\d{1,5}$")


def _request(key: str, *extra: tuple[str, str]) -> ep.HttpHeaders:
    return headers(
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":authority", "gateway"),
        ("content-type", "application/json"),
        ("authorization", f"Bearer {key}"),
        *extra,
    )


def _body(words: str = "conformance", max_tokens: int = 8) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": f"{words} " * 40, "max_tokens": max_tokens})


def _named(resp: ep.ProcessingResponse) -> tuple[str | None, str | None]:
    """The destination as the header mutation and as the dynamic metadata name it."""
    for kind in ("request_headers", "request_body"):
        if resp.HasField(kind):
            common = getattr(resp, kind).response
            break
    else:
        return None, None
    header = next(
        (
            h.header.raw_value.decode() or h.header.value
            for h in common.header_mutation.set_headers
            if h.header.key == HEADER
        ),
        None,
    )
    meta = json_format.MessageToDict(resp.dynamic_metadata).get("envoy.lb", {}).get(HEADER)
    return header, meta


class _Exchange:
    """One request through the picker, buffered, as far as its pick."""

    def __init__(self, t: Target, mode: int = BUFFERED) -> None:
        self.envoy = Envoy(ep_grpc.ExternalProcessorStub(t.channel), mode, mode, t.call_metadata)

    async def pick(
        self,
        key: str,
        body: bytes,
        *extra: tuple[str, str],
        metadata: base_pb2.Metadata | None = None,
    ) -> ep.ProcessingResponse:
        kw: dict[str, Any] = {"request_headers": _request(key, *extra)}
        if metadata is not None:
            kw["metadata_context"] = metadata
        await self.envoy.send(**kw)
        first = await self.envoy.read()
        if first.HasField("immediate_response"):
            return first
        await self.envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
        return await self.envoy.read()

    def close(self) -> None:
        self.envoy.call.cancel()


async def _pick(t: Target, *extra: tuple[str, str], **kw: Any) -> ep.ProcessingResponse:
    x = _Exchange(t)
    try:
        return await x.pick(t.api_key, _body(), *extra, **kw)
    finally:
        x.close()


def _subset(endpoints: list[str]) -> base_pb2.Metadata:
    hint = base_pb2.Metadata()
    hint.filter_metadata["envoy.lb.subset_hint"].update({SUBSET: endpoints})
    return hint


async def test_it_speaks_ext_proc(picker: Target) -> None:
    resp = await _pick(picker)
    assert resp.HasField("request_body") or resp.HasField("request_headers"), resp


async def test_full_duplex_streaming_mode_is_supported(picker: Target) -> None:
    """The body in chunks, the pick, the engine's stream back through the picker chunk by chunk,
    each chunk answered."""
    x = _Exchange(picker, FULL_DUPLEX)
    try:
        envoy = x.envoy
        await envoy.send(request_headers=_request(picker.api_key))
        body = orjson.dumps(
            {"model": MODEL, "prompt": "stream " * 40, "max_tokens": 6, "stream": True}
        )
        half = len(body) // 2
        await envoy.send(request_body=ep.HttpBody(body=body[:half], end_of_stream=False))
        await envoy.send(request_body=ep.HttpBody(body=body[half:], end_of_stream=True))
        picked = await envoy.read()
        header, meta = _named(picked)
        assert header is not None and header == meta
        sent = b""
        resp = picked
        while True:  # what the picker passes on of the body (streamed: in its own chunks)
            sent += resp.request_body.response.body_mutation.streamed_response.body
            if resp.request_body.response.body_mutation.streamed_response.end_of_stream:
                break
            resp = await envoy.read()
        status, chunks = await upstream(header.split(",")[0], "/v1/completions", sent)
        assert status == 200
        await envoy.send(
            response_headers=headers((":status", "200"), ("content-type", "text/event-stream"))
        )
        await envoy.read()
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            await envoy.send(response_body=ep.HttpBody(body=chunk, end_of_stream=last))
            answer = await envoy.read()
            assert answer.HasField("response_body")
    finally:
        x.close()


async def test_a_subset_hint_bounds_every_pick(picker: Target) -> None:
    for only in picker.pool:
        for _ in range(3):
            header, meta = _named(await _pick(picker, metadata=_subset([only])))
            assert header is not None and header == meta
            assert set(header.split(",")) == {only}  # the pick and any fallback: in the list


async def test_a_subset_with_nothing_eligible_is_503(picker: Target) -> None:
    for subset in (["192.0.2.1:8000"], []):
        resp = await _pick(picker, metadata=_subset(subset))
        assert resp.immediate_response.status.code == 503, subset


async def test_without_a_subset_every_pick_is_in_the_pool(picker: Target) -> None:
    seen: set[str] = set()
    for i in range(6):
        x = _Exchange(picker)
        try:
            header, _ = _named(await x.pick(picker.api_key, _body(f"pool {i}")))
        finally:
            x.close()
        assert header is not None
        seen |= set(header.split(","))
    assert seen and seen <= set(picker.pool)


async def test_the_destination_is_in_the_header_and_the_metadata_alike(picker: Target) -> None:
    for _ in range(3):
        header, meta = _named(await _pick(picker))
        assert header is not None and meta is not None and header == meta


async def test_the_destination_is_a_comma_separated_list_of_ip_port(picker: Target) -> None:
    header, _ = _named(await _pick(picker))
    assert header is not None
    listed = header.split(",")
    assert listed and all(IP_PORT.match(e) for e in listed), header
    assert len(set(listed)) == len(listed)


async def test_no_ready_endpoint_is_503(picker: Target) -> None:
    await picker.unready()
    resp = await _pick(picker)
    assert resp.immediate_response.status.code == 503, resp


@contextlib.asynccontextmanager
async def _loaded(t: Target) -> AsyncIterator[None]:
    """Two long requests of a critical client hold ~84 % of the pool's KV (past the point where
    sheddable work is dropped) while the block runs."""
    holders = []
    try:
        for i in range(2):
            x = _Exchange(t)
            holders.append(x)
            long_prompt = {"model": MODEL, "prompt": f"holder {i} " + "abcd" * 24_000}
            held = await x.pick(t.holder_key, orjson.dumps(long_prompt))
            assert _named(held)[0] is not None, held
        yield
    finally:
        for x in holders:
            x.close()


async def _routed(t: Target, key: str, *extra: tuple[str, str]) -> ep.ProcessingResponse:
    x = _Exchange(t)
    try:
        return await x.pick(key, _body("under load"), *extra)
    finally:
        x.close()


async def test_a_sheddable_request_under_heavy_load_is_429(picker: Target) -> None:
    """A sheddable request (its InferenceObjective's priority) is dropped with 429; a critical
    one still gets an endpoint."""
    objective = ("x-gateway-inference-objective", picker.sheddable_objective)
    async with _loaded(picker):
        shed = await _routed(picker, picker.api_key, objective)
        assert shed.immediate_response.status.code == 429, shed
        critical = await _routed(picker, picker.critical_key)
        assert _named(critical)[0] is not None, critical


async def test_the_served_endpoint_is_the_one_accounted(picker: Target) -> None:
    """The data plane went down the list: the second endpoint served."""
    x = _Exchange(picker)
    envoy = x.envoy
    try:
        picked = await x.pick(picker.api_key, _body("served"))
        header, _ = _named(picked)
        assert header is not None
        listed = header.split(",")
        served_by = listed[-1]
        sent = picked.request_body.response.body_mutation.body
        status, chunks = await upstream(served_by, "/v1/completions", sent)
        assert status == 200
        await envoy.served(served_by, b"".join(chunks), SERVED)
        for _ in range(50):
            try:
                if await picker.last_served() == served_by:
                    break
            except IndexError:
                pass
            await asyncio.sleep(0.05)
        assert await picker.last_served() == served_by
    finally:
        x.close()


async def test_the_three_health_services_answer(picker: Target) -> None:
    stub = health_pb2_grpc.HealthStub(picker.channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        for _ in range(40):
            got = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            if got.status == serving:
                break
            await asyncio.sleep(0.1)
        assert got.status == serving, service


async def test_an_objective_sets_the_priority(picker: Target) -> None:
    """Under the same load, the same client's request is routed at its own priority and dropped
    when it names the sheddable objective."""
    objective = ("x-gateway-inference-objective", picker.sheddable_objective)
    async with _loaded(picker):
        own = await _routed(picker, picker.api_key)
        assert _named(own)[0] is not None, own
        shed = await _routed(picker, picker.api_key, objective)
        assert shed.immediate_response.status.code == 429, shed
