"""A component that runs one asyncio task from ``start`` until ``stop``."""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["Background"]


class Background:
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
