"""The worker's exactly-once commit waits for the table writes buffered before it
(streams.app.flush_before_transaction_commit), and only for those."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import Any

from faust.transport.consumer import TransactionManager
from faust.types import TP

from streams.app import flush_before_transaction_commit


class _Producer:
    """Faust's producer as the transaction manager sees it: a FIFO buffer of table writes (each
    a future resolved once Kafka has it), and the commit of the transactions."""

    def __init__(self) -> None:
        self.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))
        self.buffer = SimpleNamespace(pending=SimpleNamespace(_queue=deque()))
        self.sent: list[str] = []
        self.committed_with: list[list[str]] = []

    def buffer_write(self, name: str, delay_s: float | None) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.buffer.pending._queue.append(fut)

        def send() -> None:
            self.sent.append(name)
            fut.set_result(None)

        if delay_s is not None:
            asyncio.get_running_loop().call_later(delay_s, send)

    async def commit_transactions(self, by_id: Any, group_id: str, **_: Any) -> None:
        self.committed_with.append(list(self.sent))


async def test_a_transaction_commits_after_the_table_writes_buffered_before_it() -> None:
    flush_before_transaction_commit()
    flush_before_transaction_commit()  # idempotent: wrapped once
    assert getattr(TransactionManager.commit, "flushes_first", False)
    producer = _Producer()
    app = SimpleNamespace(
        conf=SimpleNamespace(id="kvgate-worker"),
        assignor=SimpleNamespace(group_for_topic=lambda topic: 0),
        producer=producer,
    )
    tm = TransactionManager(SimpleNamespace(app=app), consumer=None, producer=producer)  # type: ignore[arg-type]
    producer.buffer_write("write 1", 0.02)
    producer.buffer_write("write 2", 0.05)
    commit = asyncio.create_task(tm.commit({TP("kvgate.kv-events", 0): 42}))
    await asyncio.sleep(0.01)
    producer.buffer_write("write 3, after the commit began", None)  # never sent: not waited for
    assert await asyncio.wait_for(commit, 5)
    assert producer.committed_with == [["write 1", "write 2"]]
