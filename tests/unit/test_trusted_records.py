"""Records rendered without the model (streams/trusted.py) read back as the model renders them."""

from typing import Any

import numpy as np
import orjson
import pytest

import streams.trusted as trusted
from admission.holdings import Holdings
from admission.reservations import InProcessReservations, Reservation
from router.decision.types import Candidate, RouteDecision, RouteRequest
from router.flow.recorder import DECISION, OUTCOME
from router.flow.served import Served
from router.parse import parse_request
from router.records import decision_fields, decision_record, outcome_fields, outcome_record
from streams.codec import decode, encode
from streams.schemas import Decision, LedgerEvent, Outcome


def _decision(**over: Any) -> tuple[dict[str, Any], Decision]:
    p = parse_request(orjson.dumps({"model": "m", "prompt": "x" * 300, "user": "s-1"}), False, 16)
    rreq = RouteRequest("r1", "m", [11, 12, 13], len(p.tokens), 16)
    candidates = (
        Candidate("n1", 0.4, 3, 1.0, 0.25, 2, True, {"queue_s": 0.01, "prefill_s": 1e-05}),
        # a score computed with numpy, a queue length counted as an int
        Candidate("n2", np.float64(-0.125), 0, 0.0, 0.0, 7, True, {"queue_s": 0.5}),
    )
    d = RouteDecision("n1", "prefix_hit", candidates)
    kw: dict[str, Any] = {
        "router_id": "rt",
        "policy": "kvgate",
        "weights_version": 2,
        "started": 1_796_000_000.25,
        "block_size": 16,
        "decision_us": 812.5,
        "index_age_s": 0.3,
        "approximate_nodes": {"n2"},
        "tenant": "acme",
        "priority": "high",
        "budget_usage": 0.4,
        "kv_blocks_estimate": 20,
        "client_request_id": "client-7",
        **over,
    }
    return decision_fields(rreq, p, d, **kw), decision_record(rreq, p, d, **kw)


def test_a_decision_reads_back_as_the_model_renders_it() -> None:
    fields, model = _decision()
    fast = trusted.record_json(DECISION, fields)
    assert decode(Decision, fast) == decode(Decision, encode(model))
    # field for field in the model's order, the defaults it left out included
    assert list(orjson.loads(fast)) == list(Decision.model_fields)
    got = decode(Decision, fast)
    assert got.schema_version == 1 and got.pool == "default"
    assert got.candidates[1].approximate_index and not got.candidates[0].approximate_index
    assert got.candidates[1].score == -0.125 and got.candidates[1].queue_len == 7.0


def test_the_bytes_are_the_models_where_the_values_have_its_types() -> None:
    fields, model = _decision()
    fields["candidates"] = [
        {**c, "queue_len": float(c["queue_len"]), "score": float(c["score"])}
        for c in fields["candidates"]
    ]
    assert trusted.record_json(DECISION, fields) == encode(model)


@pytest.mark.parametrize("checked", [False, True])
def test_a_missing_required_field_never_renders(
    checked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trusted, "CHECK", checked)
    fields, _ = _decision()
    del fields["request_id"]
    with pytest.raises(ValueError if checked else TypeError, match="request_id"):
        trusted.record_json(DECISION, fields)


def test_checked_records_refuse_unknown_fields_and_broken_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trusted, "CHECK", True)
    fields, _ = _decision()
    with pytest.raises(ValueError, match="no such fields"):
        trusted.record_json(DECISION, {**fields, "chosen": "n1"})
    with pytest.raises(ValueError):
        trusted.record_json(DECISION, {**fields, "decision_seq": 300})  # at most 255
    bad = [{**fields["candidates"][0], "hit_fraction": 1.5}]  # at most 1
    with pytest.raises(ValueError):
        trusted.record_json(DECISION, {**fields, "candidates": bad})
    assert decode(Decision, trusted.record_json(DECISION, fields)).request_id == "r1"


def test_shapes_follow_any_model() -> None:
    shape = trusted.Shape(Outcome)
    raw = trusted.record_json(
        shape,
        {
            "request_id": "r9",
            "ts": 5.0,
            "router_id": "rt",
            "node_id": None,
            "status": "ok",
            "http_status": 200,
            "e2e_s": 1.5,
            "prompt_tokens": 3,
            "output_tokens": 4,
        },
    )
    o = decode(Outcome, raw)
    assert o.resumes == 0 and o.error is None and o.output_tokens == 4


@pytest.mark.parametrize(
    "relay",
    [
        Served(
            status="ok",
            http_status=200,
            ttft_s=0.05,
            output_tokens=9,
            usage={"prompt_tokens_details": {"cached_tokens": 32}},
        ),
        Served(status="error", http_status=502, output_tokens=0, error="n1: refused"),
    ],
)
def test_an_outcome_reads_back_as_the_model_renders_it(relay: Served) -> None:
    p = parse_request(orjson.dumps({"model": "m", "prompt": "hello"}), False, 16)
    kw: dict[str, Any] = {"router_id": "rt", "started": 100.0, "now": 101.25, "reroutes": 1}
    fast = trusted.record_json(OUTCOME, outcome_fields("r1", "n1", relay, p, **kw))
    model = outcome_record("r1", "n1", relay, p, **kw)
    assert decode(Outcome, fast) == model
    assert fast == encode(model)  # (its values have the model's types: byte for byte)


@pytest.mark.parametrize("kind", ["reserve", "release", "expire", "renew"])
@pytest.mark.parametrize("tenant", ["", "acme"])
async def test_a_ledger_event_reads_back_as_the_model_renders_it(kind: str, tenant: str) -> None:
    """The router's own ledger events, rendered from their fields, against the same events
    built as the model (what the reconciler and a gate without ``publish_json`` send)."""
    models: list[LedgerEvent] = []
    rendered: list[tuple[str, bytes]] = []

    async def publish(ev: LedgerEvent) -> None:
        models.append(ev)

    r = Reservation("r1", "pool-a", 12, 1, 130.0, tenant)
    slow = Holdings(InProcessReservations(), "rt", publish)
    fast = Holdings(InProcessReservations(), "rt", publish, lambda k, v: rendered.append((k, v)))
    cause = "lease ran out" if kind == "expire" else None
    for h in (slow, fast):
        await h.record(kind, r, 100.0, cause)  # type: ignore[arg-type]
    ((key, raw),), (model,) = rendered, models
    assert key == "pool-a" and decode(LedgerEvent, raw) == model
    assert raw == encode(model)  # byte for byte: its values have the model's types
    assert model.schema_version == (2 if kind == "renew" else 1)
    assert model.tenant == (tenant or None)
