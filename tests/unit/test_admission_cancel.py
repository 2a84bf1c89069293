"""A caller that goes away in the middle of admission (an ext_proc stream Envoy resets is
cancelled) leaves nothing reserved: not its own reservation whose answer was still on its way
back from the store, and not a queued request's that a pump it was running had just made."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Literal

from admission.gate import AdmissionGate
from admission.reservations import InProcessReservations, Reservation, ReserveAsk
from admission.settings import AdmissionSettings, Tenant
from streams.schemas import LedgerEvent
from tests.factories import admit, screen

NORMAL = Tenant(name="chat", priority="normal")


class SlowAnswers(InProcessReservations):
    """A store that applies a reservation at once and answers ``delay_s`` later (a round trip
    to Redis whose reply is still on the way when the caller is cancelled)."""

    delay_s = 0.0

    async def try_reserve(
        self, ask: ReserveAsk, now: float
    ) -> Reservation | Literal["tenant"] | None:
        r = self.reserve(ask, now)
        await asyncio.sleep(self.delay_s)
        return r

    async def reserve_unguarded(
        self, ask: ReserveAsk, now: float, guard: Sequence[str] = ()
    ) -> tuple[Reservation, int, int] | Literal["tenant", "guarded"] | None:
        got = await super().reserve_unguarded(ask, now, guard)
        await asyncio.sleep(self.delay_s)
        return got


def _gate(store: SlowAnswers, events: list[LedgerEvent]) -> AdmissionGate:
    async def publish(ev: LedgerEvent) -> None:
        events.append(ev)

    s = AdmissionSettings(learn_output=False, queue_poll_s=10.0)
    return AdmissionGate(s, "rt", publish, store=store)


async def test_cancelled_while_its_reservation_is_answered_nothing_stays_held() -> None:
    store, events = SlowAnswers(), []  # type: ignore[var-annotated]
    gate = _gate(store, events)
    store.delay_s = 5.0
    task = asyncio.create_task(
        screen(gate, "r1", NORMAL, "a1", "c", 64, 16, 16, "default", [100], now=1.0)
    )
    await asyncio.sleep(0.05)
    assert await store.count() == 1  # the store made it; the answer is on its way
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert await store.count() == 0 and store._blocks.get("default", 0) == 0
    assert "r1" not in gate.held


async def test_a_pump_runs_to_its_end_when_its_caller_is_cancelled() -> None:
    """A release pumps the queue in its caller's task; cancelled while the store answers the
    reservation of the request at the queue's head, the pump still finishes: the waiter is
    admitted (and later releases), instead of waiting on with a reservation nobody holds."""
    store, events = SlowAnswers(), []  # type: ignore[var-annotated]
    gate = _gate(store, events)
    for i in range(15):  # up to the red watermark (normal may hold 90 of 100 blocks)
        assert (await admit(gate, f"r{i}", NORMAL, 64, 16, 16, "default", [100], 1.0)).admitted
    waiting = asyncio.create_task(admit(gate, "late", NORMAL, 64, 16, 16, "default", [100], 1.0))
    await asyncio.sleep(0.05)
    assert len(gate.queues) == 1
    store.delay_s = 0.2
    releasing = asyncio.create_task(gate.release("r0", 2.0))
    await asyncio.sleep(0.05)  # the pump waits on the store's answer for "late"
    releasing.cancel()
    await asyncio.gather(releasing, return_exceptions=True)
    verdict = await asyncio.wait_for(waiting, 2.0)
    assert verdict.admitted and "late" in gate.held
    for rid in [f"r{i}" for i in range(1, 15)] + ["late"]:
        await gate.release(rid, 3.0)
    assert await store.count() == 0 and not gate.held
    reserved = {e.reservation_id for e in events if e.kind == "reserve"}
    released = {e.reservation_id for e in events if e.kind == "release"}
    assert reserved == released
