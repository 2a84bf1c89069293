"""The live router's queue of held requests (router/decision/lanes.py's ``queue`` rule): requests
wait here, not in an engine's queue, while the engines are queued; one task offers them a place in
the queue's order (short requests first) whenever a request ends, and every ``poll_s``.

Each waiting request awaits its own future with a deadline; a request that leaves (its client
went away, its deadline passed) is dropped from the queue at the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from router.decision.holdqueue import UNKNOWN, HoldQueue

__all__ = ["Held", "RouterQueue", "Waiting"]

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Held:
    """What a request's ``retry`` returns when it must keep waiting: the node that holds it
    back (its best node, queued), so that the round passes over the others that want it."""

    node: str = UNKNOWN


@dataclass(slots=True)
class Waiting(Generic[R]):
    """One held request: ``retry`` routes it again on the cluster as it is now and returns the
    result when it may go, :class:`Held` (or None: held, the node unknown) when it must keep
    waiting."""

    retry: Callable[[], R | Held | None]
    future: asyncio.Future[R] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class RouterQueue(Generic[R]):
    def __init__(self, poll_s: float, max_waiting: int) -> None:
        self.poll_s = poll_s
        self.max_waiting = max_waiting
        self._queue: HoldQueue[Waiting[R]] = HoldQueue()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.max_waiting

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self) -> None:
        """Something ended: offer the waiting requests a place now."""
        self._wake.set()

    async def wait(
        self, key: float, long: bool, w: Waiting[R], timeout_s: float, blocker: str = UNKNOWN
    ) -> R | None:
        """Hold ``w`` (held back by node ``blocker``) until it may go (its ``retry`` result)
        or ``timeout_s`` has passed (None)."""
        self._queue.push(key, long, w, blocker)
        self.start()
        try:
            return await asyncio.wait_for(asyncio.shield(w.future), timeout_s)
        except TimeoutError:
            return None
        finally:
            if not w.future.done():
                w.future.cancel()  # dropped at the next round

    def _attempt(self, w: Waiting[R]) -> str | None:
        """None when ``w`` left the queue (sent, failed or gone), else what holds it back."""
        if w.future.done():  # gone: its client left or its deadline passed
            return None
        try:
            got = w.retry()
        except Exception as exc:  # that request fails; the queue goes on for the others
            w.future.set_exception(exc)
            return None
        if got is None:
            return UNKNOWN
        if isinstance(got, Held):
            return got.node
        w.future.set_result(got)
        return None

    def release(self) -> int:
        return self._queue.release(self._attempt)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()
            if len(self._queue):
                self.release()
