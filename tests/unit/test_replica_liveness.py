"""Node liveness on the router's own clock, and no retirement while the feed itself is silent."""

from __future__ import annotations

from streams.replica import TableReplica
from streams.settings import KafkaSettings, WorkerSettings
from tests.factories import heartbeat


def _beat(node: str, ts: float) -> bytes:
    return heartbeat(node, seq=int(ts), ts=ts).model_dump_json().encode()


def test_liveness_uses_receive_time_and_a_silent_feed_retires_nobody() -> None:
    r = TableReplica(KafkaSettings(), WorkerSettings(), "t", node_ttl_s=60.0, feed_stale_s=3.0)
    # an agent whose clock runs an hour behind is alive when its beats arrive now
    r._apply_input(r.hb_topic, b"slow", _beat("slow", 1000.0), now=5000.0)
    r._apply_input(r.hb_topic, b"ok", _beat("ok", 5000.0), now=5000.0)
    assert r.received == {"slow": 5000.0, "ok": 5000.0}
    assert r.expire(5001.0) == []
    # nothing at all arrives for two minutes: Kafka is away, the nodes are not known dead
    assert r.expire(5120.0) == []
    assert set(r.load) == {"slow", "ok"}
    # the feed is back, with beats from "ok" only: "slow" is retired after node_ttl_s
    r._apply_input(r.hb_topic, b"ok", _beat("ok", 5121.0), now=5121.0)
    assert r.expire(5121.5) == ["slow"]
    # bootstrap records count at their own time, never as fresh
    r._apply_changelog(r.load_topic, b"old", _beat("old", 100.0), now=5122.0)
    assert r.received["old"] == 100.0
