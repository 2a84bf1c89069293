"""SLO classes (admission/slo.py): where a request's class comes from, what a header may ask
for, the early refusal of a request that would miss its TTFT, and holding loose classes back;
in the simulator, interactive traffic keeps its SLO at 120 % load while batch gets the rest."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from admission.core import RejectReason
from admission.settings import AdmissionSettings, SloClass, Tenant
from admission.slo import deadline_refusal, expected_ttft_s, held, slo_of
from analytics.sim.slobench import slo_mix

S = AdmissionSettings()
GOLD = Tenant(name="gold", priority="high", slo_class="interactive")
ANON = Tenant(name="anonymous")


def test_the_credential_gives_the_class_and_a_header_may_only_pick_an_allowed_one() -> None:
    slo, t = slo_of({}, GOLD, S)
    assert slo is not None and slo[0] == "interactive" and t.priority == "high"
    assert slo_of({}, ANON, S) == (None, ANON)
    # a header picks a class whose priority is not above the tenant's ...
    slo, t = slo_of({"X-Kvgate-Slo-Class": "batch"}, GOLD, S)
    assert slo is not None and slo[0] == "batch" and t.priority == "normal"
    slo, t = slo_of({"X-Kvgate-Slo-Class": "standard"}, ANON, S)
    assert slo is not None and slo[0] == "standard" and t.priority == "normal"
    # ... never a tighter one, nor an unknown one
    for asked in ("interactive", "platinum"):
        with pytest.raises(ValueError, match="not available"):
            slo_of({"X-Kvgate-Slo-Class": asked}, ANON, S)
    # a tenant's list is the whole list
    listed = Tenant(name="l", priority="high", slo_classes=["batch"])
    with pytest.raises(ValueError):
        slo_of({"X-Kvgate-Slo-Class": "standard"}, listed, S)
    assert slo_of({"X-Kvgate-Slo-Class": "batch"}, listed, S)[0] is not None
    # a class never raises a request above its tenant
    low = Tenant(name="low", priority="low", slo_class="interactive")
    assert slo_of({}, low, S)[1].priority == "low"


def test_unknown_classes_in_tenant_settings_fail_at_load() -> None:
    with pytest.raises(ValidationError, match="unknown SLO class"):
        AdmissionSettings(tenants={"k": Tenant(name="t", slo_class="gold")})


def test_a_request_that_would_miss_its_ttft_is_refused_early() -> None:
    comps = {"queue_s": 3.0 * 3.0, "prefill_s": 0.5 * 3.0}  # queue weight 3, prefill weight 3
    ttft = expected_ttft_s(comps, prefill_weight=3.0, queue_weight=3.0)
    assert ttft == pytest.approx(3.5)
    interactive = ("interactive", S.slo_classes["interactive"])
    late = deadline_refusal(interactive, ttft, 0.0, S)
    assert late is not None and late.reason == RejectReason.DEADLINE
    assert late.retriable and late.retry_after_s == pytest.approx(1.5)
    assert deadline_refusal(interactive, 1.0, 0.5, S) is None
    assert deadline_refusal(interactive, 1.0, 1.5, S) is not None  # it waited in the queue
    assert deadline_refusal(None, 99.0, 0.0, S) is None
    assert expected_ttft_s({"score": 1.0}, 3.0, 1.0) is None  # a policy without components
    off = AdmissionSettings(deadline_refusal=False)
    assert deadline_refusal(interactive, 99.0, 0.0, off) is None


def test_loose_classes_are_held_while_the_best_node_is_queued() -> None:
    batch = ("batch", S.slo_classes["batch"])
    assert held(batch, {"queue_s": 0.3 * 0.2}, 0.3)  # 0.2 s queued > 0.1 s
    assert not held(batch, {"queue_s": 0.3 * 0.05}, 0.3)
    assert not held(("interactive", S.slo_classes["interactive"]), {"queue_s": 9.0}, 3.0)
    assert not held(("x", SloClass(ttft_s=1, tpot_s=1, hold_queue_s=0.0)), {}, 1.0)


def test_interactive_keeps_its_slo_at_120_percent_while_batch_gets_the_rest() -> None:
    r = slo_mix("long_tail", nodes=8, requests=2500, load=1.2)
    before, after = r["priorities"], r["slo_classes"]
    assert after["interactive"]["slo_attainment"] >= 0.99
    assert before["interactive"]["slo_attainment"] < 0.9  # the experiment measures something
    assert after["batch"]["completed"] > before["batch"]["completed"]
    for run in (before, after):
        for cls in run.values():
            assert cls["refusals_without_retry_after"] == 0
