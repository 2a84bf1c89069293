"""Property-based fuzzing of every Kafka topic's consumer: whatever bytes arrive as key or value,
a consumer skips (and counts) or dead-letters them; none raises, none is wedged afterwards."""

from __future__ import annotations

import json
from array import array
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from router.control import apply_weights
from router.decision.policies import make_policy
from router.settings import RouterSettings
from streams.codec import decode
from streams.exceptions import SchemaError
from streams.folds import KvCursor, plan_kv
from streams.ledger import LedgerReplica
from streams.replica import TableReplica
from streams.schemas import ControlMessage, Heartbeat, KvEventBatch
from streams.segments import Segment
from streams.settings import KafkaSettings, WorkerSettings
from streams.topics import ALL_TOPICS
from tests.factories import heartbeat

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=20),
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
    max_leaves=12,
)

HEARTBEAT = heartbeat("n1", seq=1, ts=10.0).model_dump(exclude={"schema_version"})
KV_BATCH = {"node_id": "n1", "epoch": "e", "seq": 1, "ts": 10.0, "block_size": 16, "stored": [1]}
LEDGER = {"reservation_id": "r", "kind": "reserve", "kv_blocks": 3, "router_id": "x", "ts": 1.0}


@st.composite
def values(draw: st.DrawFn, valid: dict[str, Any]) -> bytes | None:
    kind = draw(st.sampled_from(["mutated", "json", "bytes", "none"]))
    if kind == "none":
        return None
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    body = dict(valid)
    for _ in range(draw(st.integers(1, 3))):
        body[draw(st.sampled_from([*valid, "extra"]))] = draw(json_values)
    return json.dumps(body).encode()


keys = st.none() | st.binary(max_size=30) | st.sampled_from([b"n1", b"n1\x00\xff", b"\xff\xfe"])


@st.composite
def segments(draw: st.DrawFn) -> bytes:
    """Segment records, well-formed or cut short."""
    ids = st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=5)
    seg = Segment(
        draw(st.sampled_from(["b", "d"])),
        draw(st.integers(0, 2**32 - 1)),
        draw(st.integers(0, 2**32 - 1)),
        draw(st.integers(0, 2**32 - 1)),
        KvCursor(draw(st.text(max_size=10)), draw(st.integers(0, 2**63 - 1))),
        array("q", draw(ids)),
        array("q", draw(ids)),
    )
    raw = seg.encode()
    return raw[: draw(st.integers(0, len(raw)))] if draw(st.booleans()) else raw


segment_keys = st.sampled_from([b"n1|b0", b"n1|b1", b"n1|d0", b"n1|d15", b"n1|d16", b"|b0", b"n1"])


def _replica() -> TableReplica:
    return TableReplica(KafkaSettings(), WorkerSettings(), "fuzz")


@FUZZ
@given(
    records=st.lists(
        st.tuples(
            st.sampled_from(["hb", "kv", "load", "index"]),
            keys | segment_keys,
            values(HEARTBEAT) | values(KV_BATCH) | segments(),
        ),
        max_size=8,
    )
)
def test_the_router_replica_survives_any_record(
    records: list[tuple[str, bytes | None, bytes | None]],
) -> None:
    r = _replica()
    topics = {
        "hb": (r._apply_input, r.hb_topic),
        "kv": (r._apply_input, r.kv_topic),
        "load": (r._apply_changelog, r.load_topic),
        "index": (r._apply_changelog, r.index_topic),
    }
    for which, key, value in records:
        apply, topic = topics[which]
        r.apply_record(apply, topic, key, value, 100.0)
    # not wedged: a valid heartbeat and KV batch still fold
    assert r.apply_record(r._apply_input, r.hb_topic, b"n9", _with(HEARTBEAT, node_id="n9"), 101)
    assert r.apply_record(
        r._apply_input, r.kv_topic, b"n9", _with(KV_BATCH, node_id="n9", epoch="z"), 101
    )
    assert "n9" in r.load and r.index.match([1]).get("n9") == 1


@FUZZ
@given(
    records=st.lists(
        st.tuples(st.booleans(), keys, values(LEDGER)),
        max_size=8,
    )
)
def test_the_ledger_replica_survives_any_record(
    records: list[tuple[bool, bytes | None, bytes | None]],
) -> None:
    r = LedgerReplica(KafkaSettings(), WorkerSettings(), "fuzz")
    for changelog, key, value in records:
        apply = r._apply_changelog if changelog else r._apply_input
        r.apply_record(apply, "t", key, value, 100.0)
    assert r.apply_record(r._apply_input, "t", b"p", _with(LEDGER, reservation_id="ok"), 101)
    assert "ok" in r.book.open


@FUZZ
@given(raw=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_every_topic_decoder_either_decodes_or_raises_schema_error(raw: bytes) -> None:
    """What the sink, the worker and the agents do first with a record: anything else than a
    SchemaError would escape their dead-letter path."""
    for spec in ALL_TOPICS:
        try:
            decode(spec.value_model, raw)
        except SchemaError:
            pass


@FUZZ
@given(payload=st.dictionaries(st.sampled_from(["policy", "weights", "x"]), json_values))
def test_weights_messages_never_break_a_policy(payload: dict[str, Any]) -> None:
    rs = RouterSettings()
    policy = make_policy(rs)
    before = policy.weights_version
    msg = ControlMessage(subject="weights/kvgate", kind="weights", ts=1.0, payload=payload)
    outcome = apply_weights(policy, msg)
    assert outcome in ("applied", "other_policy", "not_newer") or outcome.startswith("invalid")
    if outcome != "applied":
        assert policy.weights_version == before


@FUZZ
@given(
    batch=st.builds(
        KvEventBatch,
        node_id=st.just("n1"),
        epoch=st.text(min_size=1, max_size=5),
        seq=st.integers(0, 2**63 - 1),
        ts=st.floats(1, 1e12),
        block_size=st.integers(1, 4096),
        stored=st.lists(st.integers(0, 2**63 - 1), max_size=20),
        removed=st.lists(st.integers(0, 2**63 - 1), max_size=20),
        cleared=st.booleans(),
        kind=st.sampled_from(["delta", "snapshot"]),
    ),
    cursor=st.none() | st.builds(KvCursor, st.text(min_size=1, max_size=5), st.integers(0, 2**63)),
    current=st.sets(st.integers(-(2**63), 2**63), max_size=20),
)
def test_the_kv_fold_takes_any_valid_batch(
    batch: KvEventBatch, cursor: KvCursor | None, current: set[int]
) -> None:
    plan = plan_kv(cursor, current, batch)
    # deletes come out of what the node holds, upserts out of what the batch stores
    assert set(plan.deletes) <= current and set(plan.upserts) <= set(batch.stored)
    if plan.apply:
        assert plan.cursor == KvCursor(batch.epoch, batch.seq)
        assert KvCursor.decode(plan.cursor.encode()) == plan.cursor


def _with(valid: dict[str, Any], **changes: Any) -> bytes:
    return orjson.dumps({**valid, **changes})


def test_models_drop_unknown_fields() -> None:
    """Extras (a newer producer's fields, or hostile ones) never ride along on a topic value:
    the model a consumer gets holds the fields it knows, and what it re-publishes (the worker's
    tables) is that model, not the bytes it received."""
    for spec in ALL_TOPICS:
        assert issubclass(spec.value_model, BaseModel)
        assert spec.value_model.model_config.get("extra") == "ignore", spec.suffix
    hb = decode(Heartbeat, _with(HEARTBEAT, junk="x" * 1000))
    assert "junk" not in hb.model_dump_json()


def test_weights_outside_their_bounds_are_refused() -> None:
    policy = make_policy(RouterSettings())
    for bad in ({"prefill_weight": 1e9}, {"prefill_weight": float("nan")}, {"step_base_s": -1}):
        weights = {"version": 99, **bad}
        msg = ControlMessage(
            subject="weights/kvgate",
            kind="weights",
            ts=1.0,
            payload={"policy": "kvgate", "weights": weights},
        )
        assert apply_weights(policy, msg).startswith("invalid"), bad
    assert policy.weights_version == 1
