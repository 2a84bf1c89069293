"""Tenant quotas on the in-process store (the Redis store runs the same scenarios in the
integration tests)."""

from __future__ import annotations

import math

import pytest

from admission.core import Budget
from admission.plan import tenant_caps, water_fill
from admission.reservations import InProcessReservations
from admission.settings import AdmissionSettings, Tenant
from tests.quotas import concurrency_and_kv_share, fair_share_when_contended


async def test_concurrency_and_kv_share() -> None:
    await concurrency_and_kv_share(InProcessReservations())


async def test_fair_share_when_contended() -> None:
    await fair_share_when_contended(InProcessReservations())


def test_water_fill_gives_each_its_weighted_share_and_what_others_leave() -> None:
    inf = math.inf
    got = water_fill(90.0, {"a": inf, "b": inf, "c": inf}, {"a": 1, "b": 2, "c": 4})
    assert got == pytest.approx({"a": 90 / 7, "b": 180 / 7, "c": 360 / 7})
    # c wants only 40: a and b share the other 50 by weight
    got = water_fill(90.0, {"a": inf, "b": inf, "c": 40.0}, {"a": 1, "b": 2, "c": 4})
    assert got == pytest.approx({"a": 50 / 3, "b": 100 / 3, "c": 40.0})
    assert water_fill(10.0, {"a": 2.0, "b": 3.0}, {}) == {"a": 2.0, "b": 3.0}  # all sated


def test_a_fair_share_counts_what_a_sated_tenant_leaves() -> None:
    """Contended: c (weight 4) holds 400 of 1,000 blocks and was not refused lately; a and b
    (weights 1, 2) were. b's cap is two thirds of what c leaves of its priority's 900 — not
    2/7 of 900, which left the pool idle while b was refused."""
    s = AdmissionSettings()
    b = Budget(1000, 100, 700, 20, 100, 0.0)
    usage = {"a": (100, 5), "b": (200, 5), "c": (400, 10)}
    weights = {"a": 1.0, "b": 2.0, "c": 4.0}
    asking = {"a", "b", "c"}
    beta = Tenant(name="b")
    blocks, _, why = tenant_caps(beta, b, usage, asking, weights, s, hungry={"a", "b"})
    assert blocks == int((900 - 400) * 2 / 3) and why.startswith("fair share")
    # every tenant asking counts as wanting more when nobody says who was refused (as before)
    blocks, _, _ = tenant_caps(beta, b, usage, asking, weights, s)
    assert blocks == int(900 * 2 / 7)
