"""Bounded priority queues, the learned output estimate and the gate's queueing."""

import asyncio

import pytest

from admission.core import RejectReason, admit
from admission.estimate import OutputEstimator
from admission.gate import AdmissionGate
from admission.queue import AdmissionQueues, Waiting
from admission.settings import AdmissionSettings, Tenant
from streams.schemas import LedgerEvent
from tests.factories import admit as gate_admit
from tests.factories import reserve
from tests.unit.test_admission import budget

S = AdmissionSettings()


def test_above_red_normal_queues_low_is_refused_high_enters() -> None:
    normal = admit(64, 16, 16, "normal", budget(900), S)
    assert not normal.admitted and normal.queue
    assert normal.rejection and normal.rejection.reason == RejectReason.RED_WATERMARK
    low = admit(64, 16, 16, "low", budget(900), S)
    assert not low.admitted and not low.queue
    assert admit(64, 16, 16, "high", budget(900), S).admitted
    full = admit(64, 16, 16, "high", budget(996), S)
    assert not full.admitted and full.queue  # past 100 %: even high waits
    off = admit(64, 16, 16, "normal", budget(900), S.model_copy(update={"queue_enabled": False}))
    assert not off.queue


def w(rid: str, priority: str = "normal", blocks: int = 10, deadline: float = 10.0) -> Waiting:
    return Waiting(rid, "default", priority, blocks, 0.0, deadline)  # type: ignore[arg-type]


def test_expected_wait_counts_the_blocks_ahead_over_the_drain_rate() -> None:
    q = AdmissionQueues(S)
    b = budget(900, drain=10.0)  # normal's limit: 900 of 1000 blocks
    assert q.offer(w("a", blocks=20), b, now=0.0) is None
    # 20 ahead + 30 own beyond the limit, at 10 blocks/s
    assert q.expected_wait_s("default", "normal", 30, b) == pytest.approx(5.0)
    # high only waits behind high (and its limit is the whole budget)
    assert q.expected_wait_s("default", "high", 30, b) == 0.0


def test_a_request_that_cannot_start_before_its_deadline_is_refused_now() -> None:
    q = AdmissionQueues(S)
    b = budget(900, drain=1.0)
    rej = q.offer(w("slow", blocks=50, deadline=10.0), b, now=0.0)  # 50 s expected > 10 s
    assert rej and rej.reason == RejectReason.QUEUE_TIMEOUT and rej.retriable
    assert rej.retry_after_s == S.max_retry_after_s or rej.retry_after_s == pytest.approx(50.0)
    assert len(q) == 0


def test_queue_full_and_strict_priority_order() -> None:
    q = AdmissionQueues(S.model_copy(update={"queue_max_entries": 2}))
    b = budget(900, drain=1000.0)
    assert q.offer(w("n1"), b, 0.0) is None and q.offer(w("n2"), b, 0.0) is None
    full = q.offer(w("n3"), b, 0.0)
    assert full and full.reason == RejectReason.QUEUE_FULL
    assert q.offer(w("h1", "high"), b, 0.0) is None
    room = budget(850)
    assert q.admissible("default", room, 0.0).request_id == "h1"  # type: ignore[union-attr]
    q.remove(q.admissible("default", room, 0.0))  # type: ignore[arg-type]
    assert q.admissible("default", room, 0.0).request_id == "n1"  # type: ignore[union-attr]
    assert q.admissible("default", budget(895), 0.0) is None  # n1 does not fit yet
    assert [x.request_id for x in q.expired(now=11.0)] == ["n1", "n2"]


def test_output_estimate_is_a_high_quantile_once_learned() -> None:
    e = OutputEstimator(quantile=0.9, min_samples=20)
    assert e.expected("t", "m", max_tokens=4096, cap=512) == 512
    for i in range(100):
        e.observe("t", "m", 100 + i)  # 100..199
    assert e.estimate("t", "m") == 190
    assert e.expected("t", "m", max_tokens=4096, cap=512) == 190
    assert e.expected("t", "m", max_tokens=50, cap=512) == 50
    assert e.expected("other", "m", max_tokens=4096, cap=512) == 512


async def test_gate_queues_above_red_and_admits_on_release() -> None:
    events: list[LedgerEvent] = []

    async def publish(ev: LedgerEvent) -> None:
        events.append(ev)

    s = AdmissionSettings(learn_output=False, queue_poll_s=0.01)
    gate = AdmissionGate(s, "rt", publish)
    normal = Tenant(name="chat", priority="normal")
    nodes = [100]  # 100 blocks: normal may hold 90
    # fill up to the red watermark: 64 prompt + 16 out = 5 blocks × 1.1 → 6 blocks each
    admitted = []
    for i in range(15):
        v = await gate_admit(gate, f"r{i}", normal, 64, 16, 16, "default", nodes, now=1.0)
        assert v.admitted
        admitted.append(f"r{i}")
    waiting = asyncio.create_task(
        gate_admit(gate, "late", normal, 64, 16, 16, "default", nodes, now=1.0)
    )
    await asyncio.sleep(0.01)
    assert not waiting.done() and gate.queues.depth("default")["normal"] == 1
    await gate.release("r0", now=2.0)  # room for one more
    v = await asyncio.wait_for(waiting, 1.0)
    assert v.admitted and v.queue_wait_s == pytest.approx(1.0)
    assert [e.kind for e in events].count("reserve") == 16
    # a client that leaves while queued is forgotten
    gone = asyncio.create_task(
        gate_admit(gate, "gone", normal, 64, 16, 16, "default", nodes, now=3.0)
    )
    await asyncio.sleep(0.01)
    gone.cancel()
    await asyncio.sleep(0.01)
    assert len(gate.queues) == 0
    # one that waits past its deadline is refused with a Retry-After
    late = asyncio.create_task(gate_admit(gate, "x", normal, 64, 16, 16, "default", nodes, now=3.0))
    await asyncio.sleep(0.01)
    await gate.pump(now=3.0 + s.queue_timeout_s["normal"] + 0.1)
    refused = await asyncio.wait_for(late, 1.0)
    assert not refused.admitted and refused.rejection
    assert refused.rejection.reason == RejectReason.QUEUE_TIMEOUT
    assert refused.rejection.retry_after_s is not None


async def test_stores_refuse_past_the_slot_limit_atomically() -> None:
    from admission.reservations import InProcessReservations

    r = InProcessReservations()
    assert await reserve(r, "a", "p", 1, 100, 0.0, 10.0, limit_slots=2)
    assert await reserve(r, "b", "p", 1, 100, 0.0, 10.0, limit_slots=2)
    assert await reserve(r, "c", "p", 1, 100, 0.0, 10.0, limit_slots=2) is None
    assert await reserve(r, "c", "p", 1, 100, 0.0, 10.0) is not None  # no slot limit given


async def test_a_release_with_an_older_clock_reading_admits_with_no_negative_wait() -> None:
    """Callers pass their own reading of the clock: a release stamped before a newer waiter
    arrived admits it with a wait of 0, never a negative one (its decision record would be
    refused)."""
    s = AdmissionSettings(learn_output=False, queue_poll_s=10.0)
    gate = AdmissionGate(s, "rt", lambda ev: asyncio.sleep(0))
    normal = Tenant(name="chat", priority="normal")
    nodes = [100]
    for i in range(15):
        assert (
            await gate_admit(gate, f"r{i}", normal, 64, 16, 16, "default", nodes, now=1.0)
        ).admitted
    waiting = asyncio.create_task(
        gate_admit(gate, "late", normal, 64, 16, 16, "default", nodes, now=5.0)
    )
    await asyncio.sleep(0.01)
    await gate.release("r0", now=4.9)  # read before the waiter arrived
    v = await asyncio.wait_for(waiting, 1.0)
    assert v.admitted and v.queue_wait_s == 0.0


def test_a_resuming_session_queues_ahead_of_new_requests_for_a_bounded_time() -> None:
    """An agent session's next turn while its KV is held goes ahead of its class's newer
    requests, never ahead of one that has waited resume_overtake_s, nor of another resuming
    turn; a higher class still comes first; with the setting at 0 it queues like anyone."""
    q = AdmissionQueues(S)  # resume_overtake_s: 2 s
    b = budget(900)  # no drain seen: nobody is refused for the wait

    def at(rid: str, t: float, resuming: bool = False, priority: str = "normal") -> Waiting:
        return Waiting(rid, "default", priority, 10, t, 60.0, None, resuming)  # type: ignore[arg-type]

    for item in (
        at("a", 0.0),
        at("b", 0.5),
        at("r1", 1.0, True),  # a and b are young: r1 goes first
        at("r2", 1.2, True),  # behind r1
        at("c", 2.8),
        at("r3", 3.0, True),  # a (3 s) and b (2.5 s) waited long enough: behind them
        at("h", 3.1, priority="high"),
    ):
        assert q.offer(item, b, item.enqueued_at) is None
    order = []
    room = budget(0)
    while (head := q.admissible("default", room, 3.1)) is not None:
        order.append(head.request_id)
        q.remove(head)
    assert order == ["h", "r1", "r2", "a", "b", "r3", "c"]
    off = AdmissionQueues(S.model_copy(update={"resume_overtake_s": 0.0}))
    for item in (at("a", 0.0), at("r", 0.1, True)):
        off.offer(item, b, item.enqueued_at)
    assert off.admissible("default", room, 0.1).request_id == "a"  # type: ignore[union-attr]


async def test_a_node_that_joins_admits_the_queue_without_another_request() -> None:
    """The queue's pump reads each budget's nodes as the router sees them now (the gate's
    ``capacity``): a waiter queued at the red watermark of one 100-block node is admitted once
    a second node joins, though no request arrived or ended since."""
    s = AdmissionSettings(learn_output=False, queue_poll_s=10.0)
    gate = AdmissionGate(s, "rt", lambda ev: asyncio.sleep(0))
    normal = Tenant(name="chat", priority="normal")
    nodes: dict[str, list[int]] = {"default": [100]}
    gate.capacity = lambda now: nodes
    for i in range(15):
        assert (
            await gate_admit(gate, f"r{i}", normal, 64, 16, 16, "default", [100], now=1.0)
        ).admitted
    waiting = asyncio.create_task(
        gate_admit(gate, "late", normal, 64, 16, 16, "default", [100], now=1.0)
    )
    await asyncio.sleep(0.01)
    await gate.pump(now=1.5)
    assert not waiting.done()  # still one node
    nodes["default"] = [100, 100]  # a node joins
    await gate.pump(now=2.0)
    v = await asyncio.wait_for(waiting, 1.0)
    assert v.admitted and v.queue_wait_s == pytest.approx(1.0)
