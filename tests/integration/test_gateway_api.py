"""The decision-only API for gateways: kvgate admits and routes, the gateway forwards, and a
companion call releases the reservation and records the outcome."""

from __future__ import annotations

import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.schemas import Decision, Outcome
from streams.settings import KafkaSettings
from streams.topics import DECISIONS, OUTCOMES
from tests.integration.cluster import MODEL, Cluster, get, post, read_topic

pytestmark = pytest.mark.integration


async def test_route_then_release(supervisor: Supervisor, kafka_settings: KafkaSettings) -> None:
    await ensure_topics(kafka_settings)
    c, router = await Cluster.two_nodes(supervisor)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "route me " * 40}],
        "max_tokens": 8,
    }
    status, routed = await post(router, "/v1/kvgate/route", body, {"X-Request-Id": "gw-1"})
    assert status == 200, routed
    rid = routed["reservation_id"]
    # kvgate mints the ids; the client's X-Request-Id is only a label on the decision
    assert routed["request_id"] == rid and rid != "gw-1" and len(rid) == 32
    assert routed["node_id"] in c.engines and routed["endpoint"] == c.engines[routed["node_id"]]
    assert routed["path"] == "/v1/chat/completions" and routed["kv_blocks_reserved"] > 0
    state = await get(router, "/v1/kvgate/state")
    assert state["reservations"] == 1 and state["inflight"] == 1

    # the gateway forwards to the engine itself
    status, answer = await post(routed["endpoint"], routed["path"], body)
    assert status == 200
    usage = answer["usage"]
    release = {
        "reservation_id": rid,
        "output_tokens": usage["completion_tokens"],
        "ttft_s": 0.05,
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
    }
    # only the gateway that routed it may release it: without a key 401, another gateway's
    # key would not even see it (404, like an unknown id)
    status, err = await post(router, "/v1/kvgate/release", release, {"X-Kvgate-Gateway-Key": ""})
    assert status == 401 and err["error"]["type"] == "unauthorized"
    status, err = await post(router, "/v1/kvgate/release", release, {"X-Kvgate-Gateway-Key": "x"})
    assert status == 401
    status, out = await post(router, "/v1/kvgate/release", release)
    assert status == 200 and out == {"released": rid}
    state = await get(router, "/v1/kvgate/state")
    assert state["reservations"] == 0 and state["inflight"] == 0
    status, again = await post(router, "/v1/kvgate/release", release)
    assert status == 404 and again["error"]["type"] == "NotFoundError"

    # refusals and bad input, as on the proxy path
    status, err = await post(router, "/v1/kvgate/route", {**body, "model": "nope"})
    assert status == 404
    status, err = await post(router, "/v1/kvgate/release", {"reservation_id": ""})
    assert status == 400 and "reservation_id" in err["error"]["message"]
    status, err = await post(router, "/v1/kvgate/release", {"reservation_id": "x", "status": "?"})
    assert status == 400

    decisions = await read_topic(kafka_settings, DECISIONS, Decision, lambda d: len(d) >= 1)
    outcomes = await read_topic(kafka_settings, OUTCOMES, Outcome, lambda o: len(o) >= 1)
    d = next(x for x in decisions if x.request_id == rid)
    o = next(x for x in outcomes if x.request_id == rid)
    assert d.client_request_id == "gw-1"
    assert d.chosen_node == routed["node_id"] and d.admission == "admitted"
    assert o.status == "ok" and o.output_tokens == usage["completion_tokens"]
    assert o.node_id == routed["node_id"] and o.ttft_s == 0.05
