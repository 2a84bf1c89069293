"""Background loops restart with backoff on any error and say so while they are down."""

from __future__ import annotations

import asyncio

from streams.background import Background


class Flaky(Background):
    max_backoff_s = 0.02

    def __init__(self, failures: int) -> None:
        self.left = failures
        self.ran = asyncio.Event()

    async def _run(self) -> None:
        if self.left:
            self.left -= 1
            raise RuntimeError("boom")
        self.running_again()
        self.ran.set()
        await asyncio.sleep(3600)


async def test_a_failing_loop_restarts_and_reports_until_it_runs() -> None:
    loop = Flaky(failures=3)
    await loop.start()
    try:
        await asyncio.sleep(0.01)
        assert loop.failing is not None and "boom" in loop.failing
        await asyncio.wait_for(loop.ran.wait(), 5)
        assert loop.failures == 3 and loop.failing is None
    finally:
        await loop.stop()
