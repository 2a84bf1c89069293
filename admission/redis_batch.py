"""Lua script calls of concurrent requests in one Redis round trip, through redis-py.

The connections :class:`admission.resp.ScriptLink` does not serve (TLS, Unix sockets,
Sentinels) send the reservation scripts here: calls made within one turn of the event loop go out
together as one pipeline (no transaction: each
script is atomic on its own, and Redis runs them one after the other in the order sent); a call
alone goes out by itself. Each caller gets its own script's reply or error; a connection failure
fails every call of that round trip.
"""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from admission.resp import Batching, ScriptCall, fail

__all__ = ["ScriptBatcher"]


class ScriptBatcher(Batching):
    def __init__(self, client: Redis, max_batch: int = 128) -> None:
        super().__init__(max_batch)
        self.client = client

    def _send(self, batch: list[ScriptCall]) -> None:
        self._spawn(self._round_trip(batch))

    async def _round_trip(self, batch: list[ScriptCall]) -> None:
        if len(batch) == 1:
            script, keys, args, fut = batch[0]
            try:
                result = await script(keys=keys, args=args)
            except BaseException as exc:
                fail(fut, exc)
            else:
                if not fut.done():
                    fut.set_result(result)
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for script, keys, args, _ in batch:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                results = await pipe.execute(raise_on_error=False)
        except BaseException as exc:
            for *_, fut in batch:
                fail(fut, exc)
            return
        for (script, keys, args, fut), result in zip(batch, results, strict=True):
            if isinstance(result, NoScriptError):  # the server lost its scripts: load, again
                try:
                    result = await script(keys=keys, args=args)
                except BaseException as exc:
                    fail(fut, exc)
                    continue
            if isinstance(result, BaseException):
                fail(fut, result)
            elif not fut.done():
                fut.set_result(result)

    async def aclose(self) -> None:
        """Send what is gathered and wait for it."""
        self.flush()
        if self._tasks:
            await asyncio.wait(set(self._tasks))
