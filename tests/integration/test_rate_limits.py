"""Per-tenant rates on real Redis: two routers (each its own gate and connections) racing for
one tenant's requests and tokens per minute hold them together, over every window, and admit
as much as they allow; the Lua script answers as the in-process log does, call for call."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest
from redis.asyncio import Redis

from admission.gate import AdmissionGate
from admission.rates import InProcessRates, RateAsk, RedisRates
from admission.settings import AdmissionSettings, Tenant
from streams.schemas import LedgerEvent
from tests.conftest import REDIS
from tests.factories import screen

pytestmark = pytest.mark.integration

WINDOW_S = 2.0
RUN_S = 8.0


async def _router(prefix: str, name: str) -> tuple[AdmissionGate, Redis]:
    async def publish(ev: LedgerEvent) -> None:
        pass

    client = Redis.from_url(REDIS)
    s = AdmissionSettings(learn_output=False, retry_guard=False, rate_window_s=WINDOW_S)
    return AdmissionGate(s, name, publish, rates=RedisRates(client, prefix)), client


def _most_in_a_window(admitted: list[tuple[float, int]]) -> int:
    """The most of ``admitted`` (at, amount) within any window of WINDOW_S."""
    admitted.sort()
    most, lo, inside = 0, 0, 0
    for at, n in admitted:
        inside += n
        while admitted[lo][0] <= at - WINDOW_S:
            inside -= admitted[lo][1]
            lo += 1
        most = max(most, inside)
    return most


async def _race(tenant: Tenant, prompt: int) -> list[tuple[float, int]]:
    """Two routers, four clients each, sending ``tenant``'s requests as fast as they are
    answered for RUN_S; what each admitted, when."""
    prefix = f"kvgate:t{uuid.uuid4().hex[:8]}"
    routers = [await _router(prefix, f"router-{i}") for i in range(2)]
    admitted: list[tuple[float, int]] = []
    end = time.time() + RUN_S

    async def client(gate: AdmissionGate, c: int) -> None:
        i = 0
        while (now := time.time()) < end:
            i += 1
            rid = f"{gate.router_id}-{c}-{i}"
            v = await screen(gate, rid, tenant, rid, "c", prompt, 16, 16, "p", [10**7], now)
            if v.admitted:
                admitted.append((now, prompt))
                await gate.release(rid, now)
            await asyncio.sleep(random.uniform(0, 0.01))

    try:
        await asyncio.gather(*(client(g, c) for g, _ in routers for c in range(4)))
    finally:
        for _, redis in routers:
            await redis.aclose()
    return admitted


async def test_two_routers_hold_a_tenants_requests_per_minute_together() -> None:
    tenant = Tenant(name="metered", requests_per_minute=600)  # 20 per 2 s window
    admitted = await _race(tenant, 64)
    per_window = 20
    assert _most_in_a_window([(at, 1) for at, _ in admitted]) <= per_window
    expected = per_window * RUN_S / WINDOW_S
    assert abs(len(admitted) - expected) <= 0.05 * expected, len(admitted)


async def test_two_routers_hold_a_tenants_tokens_per_minute_together() -> None:
    tenant = Tenant(name="metered", tokens_per_minute=30_000)  # 1,000 per 2 s window
    admitted = await _race(tenant, 90)
    assert _most_in_a_window(admitted) <= 1000
    expected = 990 * RUN_S / WINDOW_S  # 11 prompts of 90 fit a window
    got = sum(n for _, n in admitted)
    assert abs(got - expected) <= 0.05 * expected, got


async def test_the_script_answers_as_the_in_process_log_does() -> None:
    rng = random.Random(5)
    client = Redis.from_url(REDIS)
    redis_rates = RedisRates(client, f"kvgate:t{uuid.uuid4().hex[:8]}")
    local = InProcessRates()
    now, taken = 1000.0, []
    try:
        for i in range(400):
            now += rng.expovariate(20.0)
            op = rng.random()
            if op < 0.15 and taken:
                rid, tokens = rng.choice(taken), rng.randrange(1, 400)
                await redis_rates.settle("t", rid, tokens)
                await local.settle("t", rid, tokens)
                continue
            if op < 0.25 and taken:
                rid = taken.pop(rng.randrange(len(taken)))
                await redis_rates.give_back("t", rid)
                await local.give_back("t", rid)
                continue
            a = RateAsk("t", f"r{i}", rng.randrange(1, 300), 12, 2_000, 1.5)
            want, got = await local.take(a, now), await redis_rates.take(a, now)
            assert got == pytest.approx(want, abs=1e-6), (i, want, got)
            if want == 0:
                taken.append(a.rid)
    finally:
        await client.aclose()
