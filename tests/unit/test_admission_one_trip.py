"""Admission in one store round trip (``AdmissionGate.screen_and_admit``) answers what the retry
guard and then the full admission answer, in every state: below yellow it reserves at once,
anything else — guarded attempts and clients, above yellow, tenant caps, too large — is left to
the full path, so the verdicts, the reservations and the ledger events are the same."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from admission.core import Rejection, RejectReason, Verdict
from admission.gate import AdmissionGate
from admission.queue import Waiting
from admission.reservations import InProcessReservations, ReservationStore
from admission.settings import AdmissionSettings, Priority, Tenant
from admission.storm import InProcessStormStore, StormStore
from streams.schemas import LedgerEvent
from tests.factories import admit, reserve, screen

NODES = [400, 400, 200]  # 1,000 blocks, 3 nodes


@dataclass(frozen=True)
class Case:
    held: list[tuple[str, int]]  # (tenant, blocks) reserved before
    priority: Priority
    max_kv_share: float | None
    max_concurrency: int | None
    prompt_tokens: int
    max_tokens: int
    refused_attempt: bool  # this attempt was refused before, its Retry-After running
    refused_client: bool  # its client was refused before (new requests guarded: anonymous)
    waiting: bool  # a request of the same priority waits in this router's queue
    slots_per_node: int


cases = st.builds(
    Case,
    held=st.lists(
        st.tuples(st.sampled_from(["t", "u"]), st.integers(min_value=1, max_value=300)),
        max_size=6,
    ),
    priority=st.sampled_from(["low", "normal", "high"]),
    max_kv_share=st.none() | st.floats(min_value=0.05, max_value=1.0),
    max_concurrency=st.none() | st.integers(min_value=1, max_value=4),
    prompt_tokens=st.integers(min_value=1, max_value=8000),
    max_tokens=st.integers(min_value=1, max_value=2000),
    refused_attempt=st.booleans(),
    refused_client=st.booleans(),
    waiting=st.booleans(),
    slots_per_node=st.integers(min_value=1, max_value=4),
)


def _summary(v: Verdict) -> tuple[Any, ...]:
    reason = v.rejection.reason if v.rejection else None
    return v.admitted, reason, v.kv_blocks, round(v.usage_after, 9), v.output_estimate


async def compare(
    case: Case,
    make: Callable[[], Awaitable[tuple[ReservationStore, StormStore]]],
) -> None:
    """The same case on two gates in the same state: one screens and admits at once, the other
    asks the retry guard, then admits."""
    s = AdmissionSettings(queue_enabled=False, slots_per_node=case.slots_per_node)
    tenant = Tenant(
        name="t",
        priority=case.priority,
        max_kv_share=case.max_kv_share,
        max_concurrency=case.max_concurrency,
    )
    out: list[tuple[tuple[Any, ...], tuple[int, int], list[str]]] = []
    for joined in (True, False):
        events: list[LedgerEvent] = []

        async def publish(ev: LedgerEvent, events: list[LedgerEvent] = events) -> None:
            events.append(ev)

        store, storm = await make()
        gate = AdmissionGate(s, "r", publish, store, storm)
        for i, (who, blocks) in enumerate(case.held):
            await reserve(store, f"h{i}", "p", blocks, 10**6, 1.0, 600.0, None, who)
        full = Rejection(RejectReason.RED_WATERMARK, True, 30.0, "full")
        if case.refused_attempt:
            await gate.storm.refused("A", full, 1.0)
        if case.refused_client:
            await gate.storm.refused("other", full, 1.0, "anonymous@10.0.0.1")
        if case.waiting:
            w = Waiting("w", "p", case.priority, 5, 1.0, 60.0)
            gate.queues._pool("p")[case.priority].append(w)
        args = (case.prompt_tokens, case.max_tokens, 16, "p", NODES, 2.0, "m")
        client = "anonymous@10.0.0.1"
        if joined:
            v = await asyncio.wait_for(screen(gate, "x", tenant, "A", client, *args), 5)
        else:
            early = await gate.early_retry(tenant, "A", 2.0, client)
            if early is not None:
                v = Verdict(False, 0, 0.0, early)
            else:
                v = await asyncio.wait_for(admit(gate, "x", tenant, *args), 5)
        out.append((_summary(v), await store.held("p"), [e.kind for e in events]))
    assert out[0] == out[1], case


def _in_process() -> Callable[[], Awaitable[tuple[ReservationStore, StormStore]]]:
    async def make() -> tuple[ReservationStore, StormStore]:
        return InProcessReservations(), InProcessStormStore(clock=lambda: 2.0)

    return make


@settings(max_examples=400, deadline=None)
@given(case=cases)
def test_one_round_trip_answers_as_guard_then_admission(case: Case) -> None:
    asyncio.run(compare(case, _in_process()))


def test_the_common_case_reserves_below_yellow_in_one_call() -> None:
    calls: list[str] = []

    class Counting(InProcessReservations):
        async def snapshot(self, pool: str, now: float) -> tuple[int, int, float]:
            calls.append("snapshot")
            return await super().snapshot(pool, now)

    async def run() -> None:
        async def publish(_: LedgerEvent) -> None:
            pass

        gate = AdmissionGate(AdmissionSettings(), "r", publish, Counting())
        v = await screen(gate, "x", Tenant(name="t"), "A", "t", 100, 50, 16, "p", NODES, 1.0, "m")
        assert v.admitted and "x" in gate.held and calls == []
        # past yellow: the full path (a snapshot of the pool) decides
        await reserve(gate.store, "big", "p", 790, 10**6, 1.0, 600.0)
        v = await screen(gate, "y", Tenant(name="t"), "B", "t", 100, 50, 16, "p", NODES, 1.0, "m")
        assert v.admitted and calls == ["snapshot"]

    asyncio.run(run())
