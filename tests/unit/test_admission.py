import math

import pytest
from pydantic import ValidationError

from admission.core import Budget, RejectReason, admit, kv_blocks_for
from admission.exceptions import AdmissionError
from admission.gate import AdmissionGate
from admission.reservations import InProcessReservations, Reservation
from admission.settings import AdmissionSettings, Tenant
from streams.schemas import LedgerEvent
from tests.factories import admit as gate_admit
from tests.factories import reserve

S = AdmissionSettings()


def budget(reserved: int, total: int = 1000, drain: float = 100.0) -> Budget:
    return Budget(
        kv_blocks_total=total,
        slots_total=512,
        kv_blocks_reserved=reserved,
        slots_reserved=0,
        largest_node_blocks=total // 4,
        drain_blocks_per_s=drain,
    )


def test_cost_caps_the_output_estimate_and_applies_the_safety_factor() -> None:
    assert kv_blocks_for(160, 4096, 16, S) == 47  # ceil(ceil((160 + 512) / 16) × 1.1) = 47
    assert kv_blocks_for(160, 16, 16, S) == 13  # 11 blocks × 1.1 = 12.1 → 13


@pytest.mark.parametrize(
    ("reserved", "priority", "admitted", "reason"),
    [
        (700, "low", True, None),  # → ~0.71: below yellow, everyone
        (800, "low", False, RejectReason.YELLOW_LOW_PRIORITY),
        (800, "normal", True, None),
        (900, "normal", False, RejectReason.RED_WATERMARK),
        (900, "high", True, None),
        (996, "high", False, RejectReason.RED_WATERMARK),  # past 100 %: not even high priority
    ],
)
def test_watermarks_and_priorities(
    reserved: int, priority: str, admitted: bool, reason: RejectReason | None
) -> None:
    v = admit(64, 16, 16, priority, budget(reserved), S)  # type: ignore[arg-type]
    assert v.admitted is admitted
    assert (v.rejection.reason if v.rejection else None) == reason
    if v.rejection:
        assert v.rejection.retriable and v.rejection.retry_after_s is not None
        assert S.min_retry_after_s <= v.rejection.retry_after_s <= S.max_retry_after_s


def test_retry_after_follows_the_drain_rate() -> None:
    slow = admit(64, 16, 16, "normal", budget(950, drain=1.0), S).rejection
    fast = admit(64, 16, 16, "normal", budget(950, drain=50.0), S).rejection
    assert slow and fast and slow.retry_after_s > fast.retry_after_s  # type: ignore[operator]


def test_too_large_and_no_capacity() -> None:
    v = admit(16 * 300, 1, 16, "high", budget(0), S)  # 300 blocks > largest node (250)
    assert v.rejection and v.rejection.reason == RejectReason.TOO_LARGE
    assert not v.rejection.retriable
    empty = Budget(0, 0, 0, 0, 0, 0.0)
    v = admit(16, 1, 16, "high", empty, S)
    assert v.rejection and v.rejection.reason == RejectReason.NO_CAPACITY


def test_watermarks_must_rise() -> None:
    with pytest.raises(ValidationError):
        AdmissionSettings(yellow_watermark=0.9, red_watermark=0.8)


async def test_reservations_check_limit_release_expire_and_drain_rate() -> None:
    r = InProcessReservations(drain_window_s=10)
    assert await reserve(r, "a", "p", 10, limit_blocks=30, now=0, lease_s=5)
    assert await reserve(r, "b", "p", 20, limit_blocks=30, now=0, lease_s=50)
    assert await reserve(r, "c", "p", 1, limit_blocks=30, now=0, lease_s=50) is None
    assert await r.held("p") == (30, 2)
    assert await r.release("a", now=1) is not None and await r.release("a", now=1) is None
    assert await r.drain_rate("p", now=1) == 10.0  # over the span seen, at least 1 s
    assert await r.drain_rate("p", now=6) == 2.0
    assert [x.reservation_id for x in await r.expire(now=60)] == ["b"]
    assert await r.held("p") == (0, 0) and await r.count() == 0


async def test_gate_tenants_and_ledger_events() -> None:
    events: list[LedgerEvent] = []

    async def publish(ev: LedgerEvent) -> None:
        events.append(ev)

    s = AdmissionSettings(
        require_api_key=True, tenants={"k-batch": Tenant(name="batch", priority="low")}
    )
    gate = AdmissionGate(s, "rt", publish)
    assert gate.tenant("k-batch") == Tenant(name="batch", priority="low")
    for key in (None, "nope", ""):
        rej = gate.tenant(key)
        assert not isinstance(rej, Tenant) and rej.reason == RejectReason.UNAUTHORIZED
    tenant = Tenant(name="batch", priority="low")
    v = await gate_admit(gate, "r1", tenant, 64, 16, 16, "default", [100, 100], now=1)
    assert v.admitted and (await gate.store.held("default"))[0] == v.kv_blocks
    await gate.release("r1", now=2)
    assert await gate.store.held("default") == (0, 0)
    assert [e.kind for e in events] == ["reserve", "release"]


async def test_storm_guard_refuses_early_retries_with_growing_retry_after() -> None:
    from admission.core import Rejection
    from admission.storm import InProcessStormStore, StormGuard

    guard = StormGuard(InProcessStormStore(), window_s=60, max_retry_after_s=300)
    rej = Rejection(RejectReason.RED_WATERMARK, True, 2.0, "full")
    assert await guard.check("t", "a1", now=100.0) is None  # never refused: fine
    await guard.refused("a1", rej, now=100.0)
    first = await guard.check("t", "a1", now=100.5)  # 1.5 s early
    assert first is not None and first.reason == RejectReason.RETRY_STORM
    second = await guard.check("t", "a1", now=100.6)
    assert second is not None and second.retry_after_s > first.retry_after_s  # type: ignore[operator]
    assert await guard.check("t", "other", now=100.6) is None  # other attempts unaffected
    assert await guard.check("t", "a1", now=10_000.0) is None  # a client that waited is welcome
    not_retriable = Rejection(RejectReason.TOO_LARGE, False, None, "too big")
    await guard.refused("a2", not_retriable, now=100.0)
    assert await guard.check("t", "a2", now=100.1) is None


class _Unreachable(InProcessReservations):
    """A store that answers until ``down`` is set (as Redis does until it goes away)."""

    down = False

    async def snapshot(self, pool: str, now: float) -> tuple[int, int, float]:
        if self.down:
            raise AdmissionError("reservation store unavailable: connection refused")
        return await InProcessReservations.snapshot(self, pool, now)

    async def release(self, rid: str, now: float) -> Reservation | None:
        if self.down:
            raise AdmissionError("reservation store unavailable: connection refused")
        return await InProcessReservations.release(self, rid, now)


async def test_store_outage_refuses_with_503_reason_and_still_records_releases() -> None:
    events: list[LedgerEvent] = []

    async def publish(ev: LedgerEvent) -> None:
        events.append(ev)

    store = _Unreachable()
    gate = AdmissionGate(S, "r1", publish, store)
    t = Tenant(name="t")
    assert (await gate_admit(gate, "a", t, 160, 16, 16, "default", [1000], 1.0)).admitted
    store.down = True
    v = await gate_admit(gate, "b", t, 160, 16, 16, "default", [1000], 2.0)
    assert not v.admitted and v.rejection is not None
    assert v.rejection.reason == RejectReason.STORE_UNAVAILABLE and v.rejection.retry_after_s
    await gate.release("a", 3.0)  # never raises; the ledger still learns the release
    assert [(e.kind, e.reservation_id, e.cause) for e in events] == [
        ("reserve", "a", None),
        ("release", "a", "the store was unreachable"),
    ]
    assert not gate.held


async def test_the_gate_renews_the_leases_of_requests_still_served() -> None:
    events: list[LedgerEvent] = []

    async def publish(ev: LedgerEvent) -> None:
        events.append(ev)

    s = AdmissionSettings(lease_s=10.0, lease_renew_at=0.5)
    gate = AdmissionGate(s, "rt", publish)
    tenant = Tenant(name="t", priority="normal")
    for rid in ("r1", "r2"):
        assert (
            await gate_admit(gate, rid, tenant, 64, 16, 16, "default", [100, 100], now=100)
        ).admitted
    assert await gate.renew(["r1", "r2"], now=104.0) == 0  # 6 s of 10 left: not yet
    assert await gate.renew(["r1"], now=106.0) == 1  # 4 s left: renewed, r2 not asked
    assert gate.held["r1"].expires_at == 116.0 and gate.held["r2"].expires_at == 110.0
    assert (await gate.store.entries())["r1"].expires_at == 116.0
    renewed = events[-1]
    assert renewed.kind == "renew" and renewed.schema_version == 2
    assert renewed.lease_expires_at == 116.0 and renewed.reservation_id == "r1"
    assert await gate.renew(["r2"], now=107.0, force=True) == 1
    assert await gate.sweep(now=112.0) == 0  # both renewed: nothing expires
    assert await gate.sweep(now=117.5) == 2  # nobody renewed again: both expire
    assert await gate.renew(["r1", "unknown"], now=118.0, force=True) == 0
    assert [e.kind for e in events] == ["reserve", "reserve", "renew", "renew", "expire", "expire"]


class _ReleasedWhileRenewing(InProcessReservations):
    """A store whose renewal answers only after the request was released."""

    gate: AdmissionGate | None = None

    async def renew(self, rid: str, expires_at: float) -> Reservation | None:
        got = await super().renew(rid, expires_at)
        assert self.gate is not None
        await self.gate.release(rid, 109.0)  # the stream ends while the store answers
        return got


async def test_a_release_during_a_renewal_is_not_undone() -> None:
    events: list[LedgerEvent] = []

    async def publish(ev: LedgerEvent) -> None:
        events.append(ev)

    store = _ReleasedWhileRenewing()
    gate = AdmissionGate(AdmissionSettings(lease_s=10.0), "rt", publish, store)
    store.gate = gate
    tenant = Tenant(name="t", priority="normal")
    assert (await gate_admit(gate, "r1", tenant, 64, 16, 16, "default", [100], now=100)).admitted
    assert await gate.renew(["r1"], now=108.0) == 0
    assert "r1" not in gate.held and await store.count() == 0
    assert [e.kind for e in events] == ["reserve", "release"]


def test_reservations_count_what_the_engine_is_asked_to_generate() -> None:
    from admission.core import OutputShape

    base = kv_blocks_for(160, 4096, 16, S)  # capped at the configured 512
    assert base == 47
    # ignore_eos: the engine generates all of max_tokens, no learned cap applies
    assert kv_blocks_for(160, 4096, 16, S, 100, OutputShape(ignore_eos=True)) == math.ceil(
        math.ceil((160 + 4096) / 16) * 1.1
    )
    # min_tokens: never less than that (but never more than max_tokens)
    assert kv_blocks_for(160, 4096, 16, S, 16, OutputShape(min_tokens=1000)) == math.ceil(
        math.ceil((160 + 1000) / 16) * 1.1
    )
    # n / best_of: each extra output has blocks of its own; the prompt's are shared
    four = kv_blocks_for(160, 64, 16, S, None, OutputShape(sequences=4))
    assert four == math.ceil((math.ceil((160 + 64) / 16) + 3 * 4) * 1.1)


def test_the_forwarded_request_carries_the_limit_the_reservation_was_sized_for() -> None:
    import orjson
    import pytest

    from router.parse import parse_request

    p = parse_request(orjson.dumps({"model": "m", "prompt": "hi"}), False, 256)
    assert p.body["max_tokens"] == 256 == p.max_tokens
    given = parse_request(
        orjson.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 9,
                "n": 3,
                "best_of": 4,
                "min_tokens": 2,
                "ignore_eos": True,
            }
        ),
        True,
        256,
    )
    assert "max_tokens" not in given.body and given.max_tokens == 9
    assert (given.sequences, given.min_tokens, given.ignore_eos) == (4, 2, True)
    for bad in ({"n": 3, "best_of": 2}, {"min_tokens": 10, "max_tokens": 5}, {"n": 0}):
        with pytest.raises(ValueError):
            parse_request(orjson.dumps({"model": "m", "prompt": "x", **bad}), False, 256)


def test_max_completion_tokens_does_not_shrink_a_completion_reservation() -> None:
    """vLLM's completions API knows only ``max_tokens`` (its chat API prefers
    ``max_completion_tokens``): a client's ``max_completion_tokens: 1`` beside ``max_tokens``
    7,000 still gets 7,000 tokens generated, so the reservation is for 7,000 — and the simulated
    engine, which follows vLLM's rules, generates them."""
    import orjson

    from router.parse import parse_request
    from streams.openai import ChatRequest, CompletionRequest

    body = {"model": "m", "prompt": "hi", "max_tokens": 7000, "max_completion_tokens": 1}
    p = parse_request(orjson.dumps(body), False, 256)
    assert p.max_tokens == 7000 and p.body["max_tokens"] == 7000
    assert CompletionRequest.model_validate(body).output_limit(16) == 7000  # the engine's rule
    only = parse_request(
        orjson.dumps({"model": "m", "prompt": "hi", "max_completion_tokens": 1}), False, 256
    )
    assert only.max_tokens == 256 == only.body["max_tokens"]  # the limit the engine will apply
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    both = {**chat, "max_tokens": 7000, "max_completion_tokens": 5}
    assert parse_request(orjson.dumps(both), True, 256).max_tokens == 5
    assert ChatRequest.model_validate(both).output_limit(16) == 5
