"""Lua script calls of concurrent requests in one Redis round trip.

A router under load has many requests reserving and releasing at the same moment; each script
call alone costs a connection checkout, a send, a wait for the event loop and a reply. Calls
made within one turn of the event loop are sent together as one pipeline (no transaction: each
script is atomic on its own, and Redis runs them one after the other in the order sent); a call
alone in its turn goes out by itself, as before. Each caller gets its own script's reply or
error; a connection failure fails every call of that round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

__all__ = ["ScriptBatcher"]

_Call = tuple[AsyncScript, Sequence[Any], Sequence[Any], "asyncio.Future[Any]"]


class ScriptBatcher:
    def __init__(self, client: Redis, max_batch: int = 128) -> None:
        self.client = client
        self.max_batch = max_batch
        self._pending: list[_Call] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.round_trips = 0
        self.calls = 0

    async def run(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """``script(keys, args)``, sent with the other calls of this loop turn."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, keys, args, fut))
        if len(self._pending) == 1:
            loop.call_soon(self._send)
        elif len(self._pending) >= self.max_batch:
            self._send()
        return await fut

    def _send(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        task = asyncio.get_running_loop().create_task(self._round_trip(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _round_trip(self, batch: list[_Call]) -> None:
        self.round_trips += 1
        self.calls += len(batch)
        if len(batch) == 1:
            script, keys, args, fut = batch[0]
            try:
                result = await script(keys=keys, args=args)
            except BaseException as exc:
                _fail(fut, exc)
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
                _fail(fut, exc)
            return
        for (script, keys, args, fut), result in zip(batch, results, strict=True):
            if isinstance(result, NoScriptError):  # the server lost its scripts: load, again
                try:
                    result = await script(keys=keys, args=args)
                except BaseException as exc:
                    _fail(fut, exc)
                    continue
            if isinstance(result, BaseException):
                _fail(fut, result)
            elif not fut.done():
                fut.set_result(result)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if fut.done():
        return
    if isinstance(exc, asyncio.CancelledError):  # the round trip was cancelled (shutdown)
        fut.cancel()
    else:
        fut.set_exception(exc)
