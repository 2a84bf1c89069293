"""kvgate as the Gateway API Inference Extension's endpoint picker: full ext_proc exchanges as
Envoy sends them, from a gRPC client built from Envoy's own protos (``xds-protos``), against a
real router and simulated engines. The test plays Envoy: it sends the request's headers and
body, forwards the request to the endpoint the picker names, and streams the engine's answer
back through the processor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.epp import DESTINATION, EppServer, host_port, serve_epp
from router.flow.salt import tenant_salt
from tests import eppkit
from tests.conftest import wait_until
from tests.edgekit import GATEWAY, MODEL, Edge, completion, edge
from tests.eppkit import (
    BUFFERED,
    FULL_DUPLEX,
    TRANSPORTS,
    Envoy,
    destination,
    endpoints,
    headers,
    on_transport,
    outcomes,
    picker_on,
    request_headers,
    upstream,
)


@pytest.fixture(autouse=True, params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on each of the picker's gRPC servers."""
    serve = on_transport(request.param)
    monkeypatch.setattr(eppkit, "start_picker", serve)
    monkeypatch.setitem(globals(), "serve_epp", serve)
    return str(request.param)


@pytest.fixture
async def picker() -> AsyncIterator[tuple[Edge, Any, EppServer]]:
    async with picker_on(admission={"tenants": TENANTS}) as p:
        yield p


TENANTS = {
    "sk-alpha": {"name": "alpha", "priority": "normal"},
    "sk-one": {"name": "one", "priority": "normal", "max_concurrency": 1},
}


async def test_a_buffered_request_is_picked_served_and_released(
    picker: tuple[Edge, Any, EppServer],
) -> None:
    e, channel, _ = picker
    envoy = Envoy(ep_grpc.ExternalProcessorStub(channel), BUFFERED, BUFFERED)
    body = orjson.dumps({"model": MODEL, "prompt": "hello " * 40})  # no max_tokens
    await envoy.send(request_headers=request_headers())
    assert (await envoy.read()).HasField("request_headers")  # continue: the body decides
    await envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
    picked = await envoy.read()
    dest = destination(picked, "request_body")
    assert dest in {host_port(u) for u in e.engines.values()}
    assert await e.reservations() == 1
    # the router adds the default max_tokens it reserved for: the body is mutated to say so
    # and the tenant's cache_salt (router.flow.salt): the engine's cache is keyed by tenant
    sent = picked.request_body.response.body_mutation.body
    mutated = orjson.loads(sent)
    assert mutated["max_tokens"] > 0 and mutated["cache_salt"] == tenant_salt("alpha")
    removed = picked.request_body.response.header_mutation.remove_headers
    assert "content-length" in removed
    assert "authorization" in removed  # the tenant's key does not travel to the engine
    # nor a rank of the client's choosing (these engines are not data-parallel)
    assert "x-data-parallel-rank" in removed
    status, chunks = await upstream(dest, "/v1/completions", sent)
    assert status == 200
    await envoy.send(
        response_headers=headers((":status", "200"), ("content-type", "application/json"))
    )
    assert (await envoy.read()).HasField("response_headers")
    await envoy.send(response_body=ep.HttpBody(body=b"".join(chunks), end_of_stream=True))
    assert (await envoy.read()).HasField("response_body")
    await envoy.call.done_writing()
    assert await e.reservations() == 0
    (out,) = outcomes(e)
    assert out.status == "ok" and out.output_tokens > 0 and out.node_id is not None
    assert [d.request_id for d in e.decisions()] == [out.request_id]


async def test_a_full_duplex_stream_is_picked_echoed_and_observed(
    picker: tuple[Edge, Any, EppServer],
) -> None:
    e, channel, _ = picker
    envoy = Envoy(ep_grpc.ExternalProcessorStub(channel), FULL_DUPLEX, FULL_DUPLEX)
    body = orjson.dumps(completion("stream me " * 40, stream=True))
    await envoy.send(request_headers=request_headers())
    await envoy.send(request_body=ep.HttpBody(body=body[:50], end_of_stream=False))
    await envoy.send(request_body=ep.HttpBody(body=body[50:], end_of_stream=True))
    picked = await envoy.read()
    dest = destination(picked, "request_headers")
    echoed = await envoy.read()
    streamed = echoed.request_body.response.body_mutation.streamed_response
    assert streamed.end_of_stream and orjson.loads(streamed.body)["prompt"] == "stream me " * 40
    status, chunks = await upstream(dest, "/v1/completions", streamed.body)
    assert status == 200 and len(chunks) >= 1
    await envoy.send(
        response_headers=headers((":status", "200"), ("content-type", "text/event-stream"))
    )
    assert (await envoy.read()).HasField("response_headers")
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        await envoy.send(response_body=ep.HttpBody(body=chunk, end_of_stream=last))
        back = (await envoy.read()).response_body.response.body_mutation.streamed_response
        assert back.body == chunk and back.end_of_stream == last  # passed on unchanged
    await envoy.call.done_writing()
    assert await e.reservations() == 0
    (out,) = outcomes(e)
    assert out.status == "ok" and out.ttft_s is not None and out.output_tokens == 4


async def test_refusals_are_immediate_responses(picker: tuple[Edge, Any, EppServer]) -> None:
    e, channel, _ = picker
    stub = ep_grpc.ExternalProcessorStub(channel)

    async def refused(key: str, body: dict[str, Any]) -> ep.ImmediateResponse:
        envoy = Envoy(stub, BUFFERED, BUFFERED)
        await envoy.send(request_headers=request_headers(key))
        first = await envoy.read()
        if first.HasField("immediate_response"):
            return first.immediate_response
        await envoy.send(request_body=ep.HttpBody(body=orjson.dumps(body), end_of_stream=True))
        resp = await envoy.read()
        assert resp.HasField("immediate_response"), resp
        await envoy.call.done_writing()
        return resp.immediate_response

    unknown = await refused("sk-nobody", completion())
    assert unknown.status.code == 401
    missing = await refused("sk-alpha", {**completion(), "model": "no-such-model"})
    assert missing.status.code == 404 and b"no-such-model" in missing.body
    # a tenant at its concurrency limit: 429 with Retry-After
    holder = Envoy(stub, BUFFERED, BUFFERED)
    await holder.send(request_headers=request_headers("sk-one"))
    await holder.read()
    await holder.send(request_body=ep.HttpBody(body=orjson.dumps(completion()), end_of_stream=True))
    assert (await holder.read()).HasField("request_body")
    busy = await refused("sk-one", completion())
    assert busy.status.code == 429
    set_headers = {h.header.key: h.header.raw_value.decode() for h in busy.headers.set_headers}
    assert int(set_headers["retry-after"]) >= 1 and "retry-after-ms" in set_headers
    assert orjson.loads(busy.body)["error"]["kvgate_reason"]
    holder.call.cancel()  # the held one goes away: released, not leaked
    for _ in range(100):
        if await e.reservations() == 0:
            break
        await asyncio.sleep(0.05)
    assert await e.reservations() == 0


async def test_a_client_gone_mid_stream_leaves_nothing_held(
    picker: tuple[Edge, Any, EppServer],
) -> None:
    e, channel, _ = picker
    envoy = Envoy(ep_grpc.ExternalProcessorStub(channel), FULL_DUPLEX, FULL_DUPLEX)
    await envoy.send(request_headers=request_headers())
    body = orjson.dumps(completion("going away " * 40, stream=True, max_tokens=64))
    await envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
    await envoy.read()
    await envoy.read()
    await envoy.send(response_headers=headers((":status", "200")))
    await envoy.read()
    await envoy.send(response_body=ep.HttpBody(body=b'data: {"choices": [{"text": "a"}]}\n\n'))
    await envoy.read()
    assert await e.reservations() == 1
    envoy.call.cancel()  # Envoy resets the stream: the downstream client left
    for _ in range(100):
        if outcomes(e):
            break
        await asyncio.sleep(0.05)
    assert await e.reservations() == 0
    (out,) = outcomes(e)
    assert out.status == "cancelled"


async def test_health_services_answer(picker: tuple[Edge, Any, EppServer]) -> None:
    _, channel, _ = picker
    stub = health_pb2_grpc.HealthStub(channel)
    live = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
    assert live.status == health_pb2.HealthCheckResponse.SERVING
    for _ in range(40):  # readiness follows the router's (feed caught up, a healthy node)
        ready = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        if ready.status == health_pb2.HealthCheckResponse.SERVING:
            break
        await asyncio.sleep(0.1)
    assert ready.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_subset_hint_narrows_the_choice(picker: tuple[Edge, Any, EppServer]) -> None:
    e, channel, _ = picker
    stub = ep_grpc.ExternalProcessorStub(channel)
    only = host_port(e.engines["n2"])

    async def pick(subset: list[str]) -> ep.ProcessingResponse:
        envoy = Envoy(stub, BUFFERED, BUFFERED)
        hint = base_pb2.Metadata()
        hint.filter_metadata["envoy.lb.subset_hint"].update({f"{DESTINATION}-subset": subset})
        await envoy.send(request_headers=request_headers(), metadata_context=hint)
        await envoy.read()
        body = orjson.dumps(completion("subset " * 40))
        await envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
        resp = await envoy.read()
        envoy.call.cancel()
        return resp

    for _ in range(3):
        assert destination(await pick([only]), "request_body") == only
    refused = await pick(["10.9.9.9:8000"])  # none of the hinted endpoints is ours
    assert refused.immediate_response.status.code == 503
    for _ in range(100):
        if await e.reservations() == 0:
            break
        await asyncio.sleep(0.05)
    assert await e.reservations() == 0


async def test_a_body_over_the_limit_is_refused_as_it_grows(
    picker: tuple[Edge, Any, EppServer],
) -> None:
    e, channel, _ = picker
    envoy = Envoy(ep_grpc.ExternalProcessorStub(channel), FULL_DUPLEX, FULL_DUPLEX)
    await envoy.send(request_headers=request_headers())
    chunk = b"x" * (1 << 20)
    limit = e.router.settings.max_body_bytes
    for _ in range(limit // len(chunk)):
        await envoy.send(request_body=ep.HttpBody(body=chunk, end_of_stream=False))
    await envoy.send(request_body=ep.HttpBody(body=chunk, end_of_stream=False))  # one too many
    refused = await envoy.read()
    assert refused.immediate_response.status.code == 413
    assert await e.reservations() == 0


async def test_an_epp_stream_past_its_lease_stays_held_and_learns_its_first_token() -> None:
    """An EPP stream open longer than the reservation's lease: the router renews it (its EPP's
    request is its own), the first streamed token takes the prompt off the node's prefill
    backlog while the answer goes on, and the stream's end releases it and records it."""
    adm = {"tenants": TENANTS, "lease_s": 2.0, "sweep_interval_s": 0.25}
    async with edge(admission=adm) as e:
        server = await serve_epp(e.router, "127.0.0.1", 0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            envoy = Envoy(ep_grpc.ExternalProcessorStub(channel), FULL_DUPLEX, FULL_DUPLEX)
            await envoy.send(request_headers=request_headers())
            body = orjson.dumps(completion("a long answer " * 60, stream=True, max_tokens=64))
            await envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
            await envoy.read()
            await envoy.read()
            (d,) = e.decisions()
            node = d.chosen_node
            assert node is not None and e.router.ledger.prefill_backlog(node) > 0
            await envoy.send(response_headers=headers((":status", "200")))
            await envoy.read()
            first = b'data: {"choices": [{"text": "a"}]}\n\n'
            await envoy.send(response_body=ep.HttpBody(body=first))
            await envoy.read()
            assert e.router.ledger.prefill_backlog(node) == 0  # its prefill is done
            await asyncio.sleep(3.5)  # well past the 2 s lease
            assert set(e.router.gate.held) == {d.request_id} and await e.reservations() == 1
            last = b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'
            await envoy.send(response_body=ep.HttpBody(body=last, end_of_stream=True))
            await envoy.read()
            await envoy.call.done_writing()
            assert await e.reservations() == 0 and len(e.router.ledger) == 0
            (out,) = outcomes(e)
            assert out.status == "ok" and out.request_id == d.request_id
            assert out.ttft_s is not None and out.output_tokens == 2
        finally:
            await channel.close()
            await server.stop(0)


async def test_the_picker_wants_the_gateways_key_before_reading_anything(
    picker: tuple[Edge, Any, EppServer],
) -> None:
    """A stream without the gateway key (or with another) is refused UNAUTHENTICATED before a
    message of it is read; a stream with it still answers a request without a tenant key with
    the 401 of an unknown tenant key at its headers, before any body is sent."""
    e, channel, _ = picker
    stub = ep_grpc.ExternalProcessorStub(channel)
    for metadata in ((), (("x-kvgate-gateway-key", "not-a-key"),)):
        call = stub.Process(metadata=metadata)
        # the write itself fails when the status came first (gRPC's client then raises its
        # own INTERNAL for the write): the call's status is the picker's
        with pytest.raises(grpc.aio.AioRpcError):
            await call.write(ep.ProcessingRequest(request_headers=request_headers()))
            await asyncio.wait_for(call.read(), 10)
        assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
    envoy = Envoy(stub, BUFFERED, BUFFERED)
    await envoy.send(request_headers=request_headers("sk-unknown"))
    resp = await envoy.read()
    assert resp.HasField("immediate_response") and resp.immediate_response.status.code == 401
    assert await e.reservations() == 0


async def test_a_stream_routes_one_request_only(picker: tuple[Edge, Any, EppServer]) -> None:
    """A second request on a routed stream (not what Envoy sends; what a hostile or broken
    peer may) is refused: it would hold a second reservation, and the first would stay held
    until its lease ran out."""
    e, channel, _ = picker
    body = orjson.dumps(completion())
    for again in (
        ep.ProcessingRequest(request_headers=request_headers()),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
    ):
        envoy = Envoy(ep_grpc.ExternalProcessorStub(channel), BUFFERED, BUFFERED)
        await envoy.send(request_headers=request_headers())
        assert (await envoy.read()).HasField("request_headers")
        await envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
        assert (await envoy.read()).HasField("request_body")  # routed
        await envoy.call.write(again)
        answer = await envoy.read()
        assert answer.immediate_response.status.code == 400
        # the refusal ends the stream, and with it the request it routed: released, not
        # left held until its lease ran out
        assert await envoy.call.code() == grpc.StatusCode.OK

        async def released() -> bool:
            return await e.reservations() == 0

        await wait_until(released, 5, "the stream's one reservation released")
    assert [o.status for o in outcomes(e)] == ["cancelled", "cancelled"]


async def test_a_messages_request_is_routed_as_its_chat_and_its_events_read() -> None:
    """Anthropic's Messages API through the picker (``:path`` /v1/messages, the key in
    ``x-api-key``): routed, the key not passed on, the answer's named events read for its
    tokens and usage (cached tokens included) into the outcome. (Tenants' caches are shared
    here: the engines' Messages API takes no cache_salt.)"""
    router = {"epp_keys": {GATEWAY: "gw-a"}, "cache_isolation": "off"}
    async with edge(admission={"tenants": TENANTS}, router=router) as e:
        server = await serve_epp(e.router, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                await _messages_through_the_picker(e, channel)
        finally:
            await server.stop(0)


async def _messages_through_the_picker(e: Edge, channel: Any) -> None:
    envoy = Envoy(ep_grpc.ExternalProcessorStub(channel), BUFFERED, BUFFERED)
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 40}], "stream": True}
    )
    await envoy.send(
        request_headers=headers(
            (":method", "POST"), (":path", "/v1/messages"), ("x-api-key", "sk-alpha")
        )
    )
    assert (await envoy.read()).HasField("request_headers")
    await envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
    picked = await envoy.read()
    dest = destination(picked, "request_body")
    assert "x-api-key" in picked.request_body.response.header_mutation.remove_headers
    sent = picked.request_body.response.body_mutation.body
    assert orjson.loads(sent)["max_tokens"] > 0  # Anthropic's limit field, the default set
    status, chunks = await upstream(dest, "/v1/messages", sent)
    assert status == 200 and b"event: message_start" in b"".join(chunks)
    await envoy.send(
        response_headers=headers((":status", "200"), ("content-type", "text/event-stream"))
    )
    assert (await envoy.read()).HasField("response_headers")
    await envoy.send(response_body=ep.HttpBody(body=b"".join(chunks), end_of_stream=True))
    assert (await envoy.read()).HasField("response_body")
    await envoy.call.done_writing()

    async def recorded() -> bool:
        return len(outcomes(e)) == 1

    await wait_until(recorded, 5, "the outcome recorded")
    (out,) = outcomes(e)
    assert out.status == "ok" and out.output_tokens == orjson.loads(sent)["max_tokens"]
    assert out.prompt_tokens > 0 and out.cached_tokens == 0 and out.ttft_s is not None
    assert e.decisions()[-1].endpoint_kind == "messages"
    assert await e.reservations() == 0


async def test_models_and_embeddings_pass_through_the_picker(
    picker: tuple[Edge, Any, EppServer],
) -> None:
    """Not every request through the gateway generates: ``GET /v1/models`` is answered with the
        fleet's models, an embeddings request goes to a healthy node serving its model (as the
        router's own pass-through route sends it: no reservation, its body untouched, a decision
    record), and one for
        a model nobody serves gets the router's 404."""
    e, channel, _ = picker
    stub = ep_grpc.ExternalProcessorStub(channel)
    envoy = Envoy(stub, BUFFERED, BUFFERED)
    await envoy.send(
        request_headers=headers(
            (":method", "GET"),
            (":path", "/v1/models"),
            ("authorization", "Bearer sk-alpha"),
            end=True,
        )
    )
    listed = (await envoy.read()).immediate_response
    assert listed.status.code == 200
    assert [m["id"] for m in orjson.loads(listed.body)["data"]] == [MODEL]
    (m,) = e.decisions()  # answered by the router, and recorded under the id it answered with
    assert (m.endpoint_kind, m.policy, m.tenant, m.chosen_node) == (
        "models",
        "passthrough",
        "alpha",
        None,
    )
    sent = {h.header.key: h.header.raw_value.decode() for h in listed.headers.set_headers}
    assert sent["x-request-id"] == m.request_id

    envoy = Envoy(stub, BUFFERED, BUFFERED)
    body = orjson.dumps({"model": MODEL, "input": "hello"})
    await envoy.send(request_headers=request_headers(path="/v1/embeddings"))
    assert (await envoy.read()).HasField("request_headers")
    await envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
    picked = await envoy.read()
    dest = destination(picked, "request_body")
    assert dest in {host_port(u) for u in e.engines.values()}
    assert not picked.request_body.response.body_mutation.body  # sent as it came
    assert "authorization" in picked.request_body.response.header_mutation.remove_headers
    assert await e.reservations() == 1  # the KV of its input, while the engine computes
    (_, d) = e.decisions()  # recorded, as every request sent to an engine
    assert (d.endpoint_kind, d.policy, d.tenant) == ("embeddings", "passthrough", "alpha")
    assert d.chosen_node is not None and host_port(e.engines[d.chosen_node]) == dest
    assert d.admission == "admitted" and d.kv_blocks_estimate
    await envoy.send(response_headers=headers((":status", "200"), end=True))
    await envoy.read()
    assert await e.reservations() == 0  # released with the answer
    (o,) = outcomes(e)
    assert (o.request_id, o.status, o.http_status, o.node_id) == (
        d.request_id,
        "ok",
        200,
        d.chosen_node,
    )

    envoy = Envoy(stub, BUFFERED, BUFFERED)
    await envoy.send(request_headers=request_headers(path="/v1/embeddings"))
    await envoy.read()
    other = orjson.dumps({"model": "nobody-serves-this", "input": "hello"})
    await envoy.send(request_body=ep.HttpBody(body=other, end_of_stream=True))
    refused = (await envoy.read()).immediate_response
    assert refused.status.code == 404 and b"does not exist" in refused.body


async def test_fallbacks_follow_the_pick_and_the_one_that_served_is_counted(
    picker: tuple[Edge, Any, EppServer],
) -> None:
    """The EPP protocol's ordered endpoint list: the pick, then the next-best nodes the same
    request can go to; the data plane reports which served (``envoy.lb`` →
    ``x-gateway-destination-endpoint-served``) and the outcome names that node."""
    e, channel, _ = picker
    envoy = Envoy(ep_grpc.ExternalProcessorStub(channel), BUFFERED, BUFFERED)
    await envoy.send(request_headers=request_headers())
    await envoy.read()
    body = orjson.dumps(completion("fallback " * 40))
    await envoy.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
    picked = await envoy.read()
    listed = endpoints(picked, "request_body")
    assert sorted(listed) == sorted(host_port(u) for u in e.engines.values())  # both, once
    sent = picked.request_body.response.body_mutation.body
    status, chunks = await upstream(listed[1], "/v1/completions", sent)  # the first failed
    assert status == 200
    await envoy.served(listed[1], b"".join(chunks))
    fallback = next(n for n, u in e.engines.items() if host_port(u) == listed[1])
    (d,) = e.decisions()
    (out,) = outcomes(e)
    assert d.chosen_node != fallback and out.node_id == fallback
    assert await e.reservations() == 0


async def test_an_objectives_ttft_target_is_honoured() -> None:
    """``router.objective_slo_classes``: a request naming an InferenceObjective gets its SLO
    class — a TTFT no node can meet is answered 429 ``deadline`` at once (the gateway would
    otherwise wait for a late answer), a reachable one is routed; an unmapped objective changes
    nothing."""
    from admission.settings import DEFAULT_SLO_CLASSES, SloClass

    classes = {**DEFAULT_SLO_CLASSES, "instant": SloClass(ttft_s=1e-6, tpot_s=1.0)}
    admission = {"tenants": TENANTS, "slo_classes": classes}
    router = {"objective_slo_classes": {"realtime": "instant", "chat": "standard"}}
    async with picker_on(admission=admission, router=router) as (e, channel, _):
        stub = ep_grpc.ExternalProcessorStub(channel)

        async def pick(objective: str) -> ep.ProcessingResponse:
            envoy = Envoy(stub, BUFFERED, BUFFERED)
            asked = headers(
                *[(h.key, h.raw_value.decode()) for h in request_headers().headers.headers],
                ("x-gateway-inference-objective", objective),
            )
            await envoy.send(request_headers=asked)
            await envoy.read()
            await envoy.send(
                request_body=ep.HttpBody(body=orjson.dumps(completion()), end_of_stream=True)
            )
            resp = await envoy.read()
            envoy.call.cancel()
            return resp

        late = await pick("realtime")
        assert late.immediate_response.status.code == 429
        assert orjson.loads(late.immediate_response.body)["error"]["kvgate_reason"] == "deadline"
        for objective in ("chat", "not-mapped"):
            assert destination(await pick(objective), "request_body") in {
                host_port(u) for u in e.engines.values()
            }
        _, text, _ = await e.call("GET", "/metrics")
        assert 'kvgate_router_slo_requests_total{outcome="refused",slo_class="instant"} 1.0' in text
        assert "not-mapped" not in text
