"""A component that runs one asyncio task from ``start`` until ``stop``, restarted with backoff
whenever it fails (``failing`` says why while it is down; readiness checks it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

__all__ = ["Background"]

log = logging.getLogger(__name__)


class Background:
    _task: asyncio.Task[None] | None = None
    failing: str | None = None  # the error that stopped the loop, until it runs again
    failures: int = 0
    max_backoff_s: float = 30.0

    async def _run(self) -> None:
        raise NotImplementedError

    def running_again(self) -> None:
        """The loop made progress after a failure."""
        if self.failing is not None:
            log.info("%s running again", type(self).__name__)
            self.failing = None

    async def _supervised(self) -> None:
        backoff = 0.5
        while True:
            try:
                await self._run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                self.failing = f"{type(exc).__name__}: {exc}"[:300]
                log.exception("%s failed; restarting in %.1f s", type(self).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(self.max_backoff_s, backoff * 2)
            else:
                return

    @property
    def running(self) -> bool:
        """Started and not stopped (or finished) since."""
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervised())

    async def stop(self) -> None:
        task, self._task = self._task, None
        self.failing = None  # stopped: not failing
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
