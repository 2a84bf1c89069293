"""The worker's record dispatch (streams.faustpatch.dispatch_without_tasks): a callback that
does not wait costs no task and runs as if in one; a callback that waits still finishes, still
raises, and is still interrupted by the consumer's flow guard (a rebalance)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from faust.transport.conductor import Conductor
from faust.transport.consumer import Consumer
from faust.types import TP
from mode import Service
from mode.utils.locks import Event

from streams.faustpatch import FOLDED, dispatch_without_tasks, fold_input_inline

seen: contextvars.ContextVar[str] = contextvars.ContextVar("seen", default="outside")


class _Svc(Service):
    """Stands for the consumer: a mode service with its stopped/crashed events."""


@pytest.fixture
async def svc() -> AsyncIterator[_Svc]:
    dispatch_without_tasks()
    dispatch_without_tasks()  # idempotent
    assert getattr(Consumer.wait_first, "dispatches_inline", False)
    yield _Svc()


def dispatch(svc: _Svc, work: Any, guard: Any) -> Any:
    return Consumer.wait_first(svc, work, guard)  # type: ignore[arg-type]


class _Counting:
    def __init__(self) -> None:
        self.created = 0

    def __call__(self, loop: Any, coro: Any, **kw: Any) -> asyncio.Task[Any]:
        self.created += 1
        return asyncio.Task(coro, loop=loop, **kw)


async def test_a_callback_that_does_not_wait_runs_inline_without_a_task(svc: _Svc) -> None:
    done: list[str] = []

    async def callback() -> None:
        seen.set("inside")
        done.append(seen.get())

    guard_event = Event()
    guard = guard_event.wait()
    loop = asyncio.get_running_loop()
    counting = _Counting()
    loop.set_task_factory(counting)
    try:
        await dispatch(svc, callback(), guard)
    finally:
        loop.set_task_factory(None)
    assert done == ["inside"] and counting.created == 0
    assert seen.get() == "outside"  # its context was a copy, as a task's is
    assert guard.cr_frame is None  # the unused guard was closed (no 'never awaited' warning)


async def test_a_callback_that_waits_finishes_in_a_task(svc: _Svc) -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    done: list[object] = []

    async def callback() -> None:
        seen.set("inside")
        done.append(await gate)
        await asyncio.sleep(0)  # a bare yield to the loop
        done.append(seen.get())

    asyncio.get_running_loop().call_later(0.05, gate.set_result, 7)
    await asyncio.wait_for(dispatch(svc, callback(), Event().wait()), 2)
    assert done == [7, "inside"]
    assert seen.get() == "outside"


async def test_errors_reach_the_consumer_before_and_after_waiting(svc: _Svc) -> None:
    async def fails_at_once() -> None:
        raise ValueError("bad record")

    with pytest.raises(ValueError, match="bad record"):
        await dispatch(svc, fails_at_once(), Event().wait())

    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def fails_later() -> None:
        await gate
        raise KeyError("later")

    asyncio.get_running_loop().call_later(0.02, gate.set_result, None)
    with pytest.raises(KeyError):
        await asyncio.wait_for(dispatch(svc, fails_later(), Event().wait()), 2)


async def test_the_flow_guard_interrupts_a_callback_that_waits(svc: _Svc) -> None:
    stuck: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cleaned: list[bool] = []

    async def callback() -> None:
        try:
            await stuck  # a full stream buffer that never drains
        finally:
            cleaned.append(True)

    suspend_flow = Event()
    asyncio.get_running_loop().call_later(0.05, suspend_flow.set)
    await asyncio.wait_for(dispatch(svc, callback(), suspend_flow.wait()), 2)
    await asyncio.sleep(0.01)
    assert cleaned == [True] and stuck.cancelled()


class _Flow:
    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active


async def test_records_of_folded_topics_go_straight_to_their_fold() -> None:
    """fold_input_inline: a topic with a fold gets its records folded at dispatch (no channel,
    stream or acknowledgement); other topics still go through Faust's per-partition callback;
    while the flow is suspended (a rebalance) a folded topic's record is dropped unfolded."""
    fold_input_inline()
    fold_input_inline()  # idempotent
    folded: list[tuple[str, int]] = []
    delivered: list[tuple[str, int]] = []

    async def fold(message: Any) -> None:
        folded.append((message.topic, message.offset))

    async def through_faust(message: Any) -> None:
        delivered.append((message.topic, message.offset))

    flow = _Flow()
    app = SimpleNamespace(client_only=False, flow_control=flow, inline_folds={"in": fold})
    conductor = SimpleNamespace(
        app=app,
        _tp_to_callback={TP("changelog", 0): through_faust},
        _tp_to_callback_lock=asyncio.Lock(),
    )
    on_message = Conductor._compile_message_handler(conductor)  # type: ignore[arg-type]

    def record(topic: str, offset: int) -> Any:
        return SimpleNamespace(topic=topic, partition=0, offset=offset, tp=TP(topic, 0))

    assert await on_message(record("in", 0)) is FOLDED
    assert await on_message(record("changelog", 5)) is None
    flow.active = False
    assert await on_message(record("in", 1)) is FOLDED
    assert folded == [("in", 0)] and delivered == [("changelog", 5)]


async def test_a_folded_record_does_not_give_way_to_the_loop(svc: _Svc) -> None:
    """The dispatch of a record that was folded inline returns without a loop iteration (there
    is no stream that must take it first)."""
    order: list[str] = []

    async def folded() -> object:
        order.append("fold")
        return FOLDED

    async def other() -> None:
        order.append("other")

    loop = asyncio.get_running_loop()
    loop.call_soon(order.append, "loop")
    await dispatch(svc, folded(), Event().wait())
    order.append("after")
    await dispatch(svc, other(), Event().wait())
    assert order == ["fold", "after", "other", "loop"]


async def test_the_workers_fetch_wait_is_set_on_its_running_consumer() -> None:
    """Faust builds its worker consumer with a 1,500 ms fetch wait; the worker shortens it on
    the running fetcher (each fetch request reads it) and gives it back for a recovery. A real
    aiokafka consumer, started against a broker that does not answer, has no fetcher yet."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.consumer.fetcher import Fetcher

    from streams.faustpatch import FAUST_FETCH_WAIT_MS, set_fetch_wait

    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")
    app = SimpleNamespace(consumer=SimpleNamespace(_thread=SimpleNamespace(_consumer=consumer)))
    assert not set_fetch_wait(app, 100)  # not started: nothing to set
    fetcher = Fetcher.__new__(Fetcher)
    fetcher._fetch_max_wait_ms = FAUST_FETCH_WAIT_MS
    consumer._fetcher = fetcher
    try:
        assert set_fetch_wait(app, 100) and fetcher._fetch_max_wait_ms == 100
        assert set_fetch_wait(app, FAUST_FETCH_WAIT_MS)
        assert fetcher._fetch_max_wait_ms == FAUST_FETCH_WAIT_MS
        assert not set_fetch_wait(SimpleNamespace(consumer=SimpleNamespace()), 100)
    finally:
        consumer._fetcher = None
        await consumer.stop()
