"""The worker's record dispatch (streams.faustpatch.dispatch_without_tasks): a callback that
does not wait costs no task and runs as if in one; a callback that waits still finishes, still
raises, and is still interrupted by the consumer's flow guard (a rebalance)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from typing import Any

import pytest
from faust.transport.consumer import Consumer
from mode import Service
from mode.utils.locks import Event

from streams.faustpatch import dispatch_without_tasks

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
