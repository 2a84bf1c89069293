"""OpenTelemetry traces of the router: off by default; on, a request continues the client's
trace with admission, routing and proxy spans, the engine gets the proxy span's context, and the
spans reach an OTLP/HTTP collector as the OTLP protocol encodes them."""

from __future__ import annotations

import asyncio

from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.tracing import Tracing
from tests.edgekit import _serve, bearer, completion, edge, recording_engine

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


async def test_spans_continue_the_clients_trace_and_reach_the_engine() -> None:
    exporter = InMemorySpanExporter()
    async with recording_engine() as (url, seen):
        async with edge() as plain:
            assert not plain.router.tracing.on  # off unless an endpoint is set
        async with edge(tracing=Tracing(None, "kvgate-router/test", exporter=exporter)) as e:
            for node in e.engines:
                e.engines[node] = url
            for _ in range(50):
                headers = {**bearer("sk-alpha"), "traceparent": PARENT}
                status, _, _ = await e.call("POST", "/v1/completions", completion(), headers)
                if seen.headers:
                    break
                await asyncio.sleep(0.05)
            assert status == 200 and seen.headers
            e.router.tracing.shutdown()
    spans = exporter.get_finished_spans()
    names = {s.name for s in spans}
    assert {"kvgate.request", "kvgate.admission", "kvgate.route", "kvgate.proxy"} <= names
    last = [s for s in spans if s.name == "kvgate.proxy"][-1]
    assert f"{last.context.trace_id:032x}" == TRACE  # the client's trace goes on
    by_id = {s.context.span_id: s for s in spans}
    assert by_id[last.parent.span_id].name == "kvgate.request"  # proxy is the request's child
    sent = seen.headers[-1]["traceparent"]
    assert sent.split("-")[1] == TRACE and sent.split("-")[2] == f"{last.context.span_id:016x}"


async def test_spans_reach_an_otlp_http_collector() -> None:
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def collector(request: web.Request) -> web.Response:
        msg = trace_service_pb2.ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        received.append(msg)
        return web.Response(
            body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    app = web.Application()
    app.router.add_post("/v1/traces", collector)
    runner, url = await _serve(app)
    try:
        tracing = Tracing(url + "/v1/traces", "kvgate-router/otlp")
        with tracing.span("kvgate.request", {"http.route": "/v1/completions"}):
            with tracing.span("kvgate.route", {"kvgate.node": "n1"}):
                pass
        await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)
    finally:
        await runner.cleanup()
    spans = [
        span
        for msg in received
        for rs in msg.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    assert {s.name for s in spans} == {"kvgate.request", "kvgate.route"}
    service = {
        a.value.string_value
        for msg in received
        for rs in msg.resource_spans
        for a in rs.resource.attributes
        if a.key == "service.name"
    }
    assert service == {"kvgate-router/otlp"}
