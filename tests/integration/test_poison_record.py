"""A record the broker will never take (larger than its ``message.max.bytes``) is set aside and
counted, not retried forever: the records behind it are delivered, and the router's own records
can never grow that large (identifiers past 256 characters become their digest, a record keeps
at most ``MAX_RECORDED_BLOCKS`` prompt blocks)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from router.decision.types import RouteDecision, RouteRequest
from router.parse import parse_request
from router.records import MAX_RECORDED_BLOCKS, decision_record
from streams.codec import encode
from streams.kafka import KafkaBus, ensure_topics
from streams.schemas import Outcome
from streams.settings import KafkaSettings
from streams.topics import OUTCOMES
from tests.factories import outcome
from tests.integration.cluster import read_topic

pytestmark = pytest.mark.integration


async def test_a_record_the_broker_refuses_is_set_aside_and_the_rest_delivered(
    kafka_settings: KafkaSettings,
) -> None:
    await ensure_topics(kafka_settings)
    bus = KafkaBus(kafka_settings, "t-poison")
    await bus.start()
    try:
        # 2 MiB: under the producer's request limit (8 MiB), over the broker's (1 MiB)
        await bus.publish(OUTCOMES, "big", outcome("big", error="x" * (2 << 20)))
        await bus.publish(OUTCOMES, "after", outcome("after"))
        await asyncio.wait_for(bus.flush(), 30)  # not stuck behind the refused record
        assert bus.refused == {OUTCOMES.name(kafka_settings.namespace): 1}
        assert bus.queued == 0
    finally:
        await bus.stop()
    got = await read_topic(
        kafka_settings, OUTCOMES, Outcome, lambda xs: any(o.request_id == "after" for o in xs)
    )
    assert [o.request_id for o in got] == ["after"]


def test_the_routers_records_stay_small_whatever_the_request() -> None:
    huge_user = "u" * (2 << 20)
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "user": huge_user}
    p = parse_request(orjson.dumps(body), False, 256)
    assert p.session_id is not None and p.session_id.startswith("sha256:")
    again = parse_request(orjson.dumps(body), False, 256)
    assert again.session_id == p.session_id  # the same session, as before
    rreq = RouteRequest("r1", "m", list(range(120_000)), 1_900_000, 4)  # a refused huge prompt
    d = RouteDecision(None, "no_fit", ())
    rec = decision_record(
        rreq,
        p,
        d,
        router_id="r",
        policy="kvgate",
        weights_version=0,
        started=1.0,
        block_size=16,
        decision_us=1.0,
        index_age_s=None,
    )
    assert len(rec.block_hashes) == MAX_RECORDED_BLOCKS
    assert len(encode(rec)) < 1 << 20
