"""Recorded traffic → trace and metrics; the replay comparison; time parsing."""

from __future__ import annotations

import pytest

from admission.settings import AdmissionSettings
from agents.profile import EngineProfile
from analytics.recorded import Recorded, RecordedRequest, recorded_metrics, to_trace
from analytics.tuning import (
    REFUSED,
    Candidate,
    ReplaySide,
    _changes,
    compare,
    parse_when,
    render_html,
    render_text,
)
from router.settings import RouterSettings


def rec_request(i: int, **kw: object) -> RecordedRequest:
    values: dict[str, object] = {
        "request_id": f"r{i}",
        "ts": 1000.0 + i * 0.5,
        "tenant": "t",
        "priority": "normal",
        "session_id": None,
        "prompt_tokens": 512,
        "max_tokens": 64,
        "block_size": 16,
        "block_hashes": tuple(range(100, 132)),  # one shared 512-token prompt
        "admission": "admitted",
        "admission_reason": "ok",
        "chosen_node": f"n{i % 2}",
        "reason": "prefix_hit",
        "queue_wait_s": 0.0,
        "output_tokens_estimate": None,
        "status": "ok",
        "ttft_s": 0.02,
        "tpot_s": 0.006,
        "e2e_s": 0.4,
        "output_tokens": 32,
        "cached_tokens": 496,
    }
    values.update(kw)
    return RecordedRequest(**values)  # type: ignore[arg-type]


def recorded() -> Recorded:
    reqs = [rec_request(i) for i in range(40)]
    reqs.append(
        rec_request(
            40,
            admission="rejected",
            admission_reason="red_watermark",
            chosen_node=None,
            status="rejected",
            output_tokens=0,
            output_tokens_estimate=20,
            queue_wait_s=0.0,
        )
    )
    return Recorded(tuple(reqs), {"n0": 2000, "n1": 2000}, 1000.0, 1030.0)


def test_parse_when() -> None:
    now = 10_000.0
    assert parse_when("now", now) == now
    assert parse_when("-30m", now) == now - 1800
    assert parse_when("-2h", now) == now - 7200
    assert parse_when("1234.5", now) == 1234.5
    assert parse_when("2026-11-30T00:00:00", now) == parse_when("2026-11-30T00:00:00+00:00", now)
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_when("yesterday", now)


def test_recorded_window_becomes_a_trace_with_refused_requests_included() -> None:
    rec = recorded()
    trace = to_trace(rec)
    assert len(trace.requests) == 41 and trace.block_size == 16
    refused = next(r for r in trace.requests if r.request_id == "r40")
    assert refused.output_tokens == 20  # what it was expected to produce
    assert trace.requests[0].output_tokens == 32  # what it did produce
    m = recorded_metrics(rec)
    assert m["offered"] == 41 and m["requests"] == 40
    assert m["hit_rate"] == pytest.approx(496 / 512)
    assert m["rejections"] == {"red_watermark": 1}
    assert m["load_cov"] == 0.0  # 20 / 20


def test_compare_shows_what_a_candidate_changes() -> None:
    rec = recorded()
    trace = to_trace(rec)
    profile = EngineProfile()
    current = Candidate(RouterSettings(), AdmissionSettings(enabled=False), profile)
    rr = Candidate(RouterSettings(policy="round_robin"), AdmissionSettings(enabled=False), profile)
    same = compare(rec, trace, current, current)
    assert same["changes_vs_current"]["changed"] == 0
    report = compare(rec, trace, current, rr)
    assert list(report["sides"]) == ["recorded", "replay: current", "replay: candidate"]
    cand = report["sides"]["replay: candidate"]["metrics"]
    cur = report["sides"]["replay: current"]["metrics"]
    assert cand["hit_rate"] < cur["hit_rate"]
    assert report["changes_vs_current"]["changed"] > 0
    assert report["changes_vs_recorded"]["now_admitted"] == 1  # admission off admits r40
    text = render_text(report)
    assert "prefix hit rate" in text and "→ round_robin" in text
    page = render_html(report)
    assert page.startswith("<!doctype html>") and page.count("<img") == 3


def test_another_holder_of_the_same_prefix_is_a_tie_not_a_change() -> None:
    a = ReplaySide(
        "a",
        {},
        {
            "r1": ("n1", "prefix_hit", 7),
            "r2": ("n1", "prefix_hit", 7),
            "r3": ("n1", "least_cost", 0),
            "r4": (REFUSED, "red_watermark", None),
        },
    )
    b = ReplaySide(
        "b",
        {},
        {
            "r1": ("n2", "prefix_hit", 7),  # the other holder, as much reused: a tie
            "r2": ("n2", "prefix_hit", 3),  # less reused there: a change
            "r3": ("n1", "least_cost", 0),  # the same node: no change
            "r4": ("n2", "least_cost", 0),  # admitted now: a change
        },
    )
    c = _changes(a, b)
    assert (c["compared"], c["changed"], c["ties"], c["now_admitted"]) == (4, 2, 1, 1)
    assert [s["request_id"] for s in c["sample"]] == ["r2", "r4"]
