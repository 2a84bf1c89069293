"""The endpoint picker in a real router process, with Kafka, the worker, simulated engines and
the ClickHouse sink: exchanges driven as Envoy drives them (a client built from Envoy's protos)
end with nothing held and their decisions and outcomes in ClickHouse."""

from __future__ import annotations

from pathlib import Path

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from deploy.procs import Supervisor, free_port
from router.epp import DESTINATION
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.chfront import ChdbFront, sink_env
from tests.conftest import wait_until
from tests.integration.cluster import GATEWAY_KEY, MODEL, Cluster, get, long_prompt

pytestmark = pytest.mark.integration

BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def _headers(*pairs: tuple[str, str], end: bool = False) -> ep.HttpHeaders:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=end)


async def test_picked_requests_land_in_clickhouse(
    supervisor: Supervisor, kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    import aiohttp

    await ensure_topics(kafka_settings)
    with ChdbFront(str(tmp_path / "ch")) as front:

        def count(sql: str) -> int:
            return int(front._run(sql, "CSV") or b"0")

        supervisor.env.update(
            sink_env(front, kafka_settings.namespace, KVGATE_SINK__BATCH_INTERVAL_S="0.2")
        )
        c = Cluster(supervisor)
        c.add_engine("n1")
        c.add_engine("n2")
        c.add_worker()
        supervisor.spawn("sink", "sink")
        epp_port = free_port()
        url = c.add_router(
            env={
                "KVGATE_ROUTER__EPP_PORT": str(epp_port),
                "KVGATE_ROUTER__EPP_KEYS": f'{{"{GATEWAY_KEY}": "test-gateway"}}',
            }
        )
        await c.wait_ready("router", 2)
        ids = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp_port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            for i in range(3):
                call = stub.Process(metadata=(("x-kvgate-gateway-key", GATEWAY_KEY),))
                first = ep.ProcessingRequest(
                    request_headers=_headers(
                        (":method", "POST"),
                        (":path", "/v1/completions"),
                        ("content-type", "application/json"),
                        ("x-request-id", f"envoy-{i}"),
                    )
                )
                first.protocol_config.request_body_mode = BUFFERED
                first.protocol_config.response_body_mode = BUFFERED
                await call.write(first)
                assert (await call.read()).HasField("request_headers")
                body = {"model": MODEL, "prompt": long_prompt(f"epp{i}"), "max_tokens": 3}
                await call.write(
                    ep.ProcessingRequest(
                        request_body=ep.HttpBody(body=orjson.dumps(body), end_of_stream=True)
                    )
                )
                picked = await call.read()
                mutation = picked.request_body.response.header_mutation.set_headers
                named = {h.header.key: h.header.raw_value.decode() for h in mutation}[DESTINATION]
                dest = named.split(",")[0]  # the pick, then its fallbacks
                sent = picked.request_body.response.body_mutation.body or orjson.dumps(body)
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(f"http://{dest}/v1/completions", data=sent) as r,
                ):
                    answer = await r.read()
                    assert r.status == 200
                await call.write(
                    ep.ProcessingRequest(response_headers=_headers((":status", "200")))
                )
                await call.read()
                await call.write(
                    ep.ProcessingRequest(response_body=ep.HttpBody(body=answer, end_of_stream=True))
                )
                await call.read()
                await call.done_writing()
                ids.append(f"envoy-{i}")
        state = await get(url, "/v1/kvgate/state")
        assert state["reservations"] == 0 and state["inflight"] == 0

        async def landed() -> bool:
            labels = ", ".join(f"'{x}'" for x in ids)
            decided = count(
                f"SELECT count() FROM kvgate.decisions FINAL WHERE client_request_id IN ({labels})"
            )
            picked = (
                "SELECT request_id FROM kvgate.decisions FINAL "
                f"WHERE client_request_id IN ({labels})"
            )
            finished = count(
                "SELECT count() FROM kvgate.outcomes FINAL "
                f"WHERE status = 'ok' AND request_id IN ({picked})"
            )
            return decided == 3 and finished == 3

        await wait_until(
            landed, 60, "the picked requests' decisions and outcomes in ClickHouse", 0.5
        )
