"""Per-tenant requests and tokens per minute (admission/rates.py): a sliding window, the wait
until it has room as Retry-After, corrections by the outcome, and requests refused for another
reason given back."""

from __future__ import annotations

import math

from admission.gate import AdmissionGate
from admission.rates import NEVER, InProcessRates, RateAsk
from admission.settings import AdmissionSettings, Tenant
from streams.schemas import LedgerEvent
from tests.factories import screen


def ask(rid: str, tokens: int = 10, requests: int | None = 3, limit: int | None = None) -> RateAsk:
    return RateAsk("t", rid, tokens, requests, limit, 10.0)


async def test_requests_hold_over_every_window_and_the_wait_is_until_the_oldest_leaves() -> None:
    r = InProcessRates()
    for i, at in enumerate((0.0, 1.0, 2.0)):
        assert await r.take(ask(f"r{i}"), at) == 0
    assert await r.take(ask("r3"), 5.0) == 5.0  # r0 (at 0) leaves the window at 10
    assert await r.take(ask("r3"), 10.5) == 0
    assert math.isclose(await r.take(ask("r4"), 10.6), 0.4)  # r1 (at 1) leaves at 11


async def test_tokens_count_the_prompt_then_what_was_served() -> None:
    r = InProcessRates()
    assert await r.take(ask("a", 600, None, 1000), 0.0) == 0
    assert await r.take(ask("b", 300, None, 1000), 1.0) == 0
    assert await r.take(ask("c", 200, None, 1000), 2.0) == 8.0  # until a (600) leaves, at 10
    await r.settle("t", "b", 100)  # b used less than its prompt said (a cut-off answer)
    assert await r.take(ask("c", 200, None, 1000), 2.0) == 0
    await r.settle("t", "c", 500)  # c's answer was long: 600 + 100 + 500 held
    assert await r.take(ask("d", 100, None, 1000), 3.0) == 7.0
    assert await r.take(ask("huge", 1001, None, 1000), 3.0) == NEVER


async def test_a_request_given_back_no_longer_counts() -> None:
    r = InProcessRates()
    for rid in ("a", "b", "c"):
        assert await r.take(ask(rid), 0.0) == 0
    assert await r.take(ask("d"), 0.0) > 0
    await r.give_back("t", "b")
    assert await r.take(ask("d"), 0.0) == 0
    assert await r.take(ask("a"), 0.0) == 0  # taken already: counted once


def test_a_routers_share_of_a_limit_keeps_one_request() -> None:
    a = RateAsk("t", "r", 10, 100, 1000, 60.0).scaled(0.25)
    assert (a.requests, a.tokens_limit) == (25, 250)
    assert RateAsk("t", "r", 10, 2, None, 60.0).scaled(0.25).requests == 1


def _gate(tenant: Tenant, **settings: object) -> AdmissionGate:
    async def publish(ev: LedgerEvent) -> None:
        pass

    s = AdmissionSettings(learn_output=False, retry_guard=False, **settings)  # type: ignore[arg-type]
    return AdmissionGate(s, "rt", publish)


async def test_the_gate_refuses_over_the_rate_with_its_wait_and_gives_back_other_refusals() -> None:
    t = Tenant(name="metered", requests_per_minute=120)  # 2 per second, 20 per 10 s window
    gate = _gate(t, rate_window_s=10.0, queue_enabled=False)
    for i in range(20):
        v = await screen(gate, f"r{i}", t, f"a{i}", "c", 64, 16, 16, "p", [100_000], 100.0 + i / 10)
        assert v.admitted, i
        await gate.release(f"r{i}", 100.0 + i / 10)
    v = await screen(gate, "r20", t, "a20", "c", 64, 16, 16, "p", [100_000], 102.0)
    assert not v.admitted and v.rejection is not None
    assert v.rejection.reason == "rate_limited" and v.rejection.retriable
    assert math.isclose(v.rejection.retry_after_s or 0, 8.0)  # r0 (at 100) leaves at 110
    # a request refused by the budget is not counted: the rate is not spent on it
    big = await screen(gate, "big", t, "ab", "c", 64_000, 16, 16, "p", [10], 111.0)
    assert not big.admitted and big.rejection is not None
    assert big.rejection.reason != "rate_limited"
    assert (await screen(gate, "ok", t, "ao", "c", 64, 16, 16, "p", [100_000], 111.0)).admitted


async def test_a_prompt_over_the_whole_token_limit_is_refused_for_good() -> None:
    t = Tenant(name="metered", tokens_per_minute=600)
    gate = _gate(t, rate_window_s=60.0)
    v = await screen(gate, "r", t, "a", "c", 1000, 16, 16, "p", [100_000], 1.0)
    assert v.rejection is not None and v.rejection.reason == "rate_limited"
    assert not v.rejection.retriable and v.rejection.retry_after_s is None
