"""Tenant quotas on the in-process store (the Redis store runs the same scenarios in the
integration tests)."""

from __future__ import annotations

from admission.reservations import InProcessReservations
from tests.quotas import concurrency_and_kv_share, fair_share_when_contended


async def test_concurrency_and_kv_share() -> None:
    await concurrency_and_kv_share(InProcessReservations())


async def test_fair_share_when_contended() -> None:
    await fair_share_when_contended(InProcessReservations())
