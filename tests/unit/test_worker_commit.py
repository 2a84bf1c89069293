"""The worker's exactly-once commit drains Faust's producer buffer before it commits the
transaction (streams.app.flush_before_transaction_commit)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from faust.transport.consumer import TransactionManager
from faust.types import TP

from streams.app import flush_before_transaction_commit


class _Producer:
    """Faust's producer as the transaction manager uses it: a buffer of table writes not handed
    to Kafka yet, and the commit of the transactions."""

    def __init__(self) -> None:
        self.buffered = ["changelog write 1", "changelog write 2"]
        self.sent: list[str] = []
        self.committed_with: list[list[str]] = []

    async def flush(self) -> None:
        self.sent += self.buffered
        self.buffered = []

    async def commit_transactions(self, by_id: Any, group_id: str, **_: Any) -> None:
        self.committed_with.append(list(self.sent))


async def test_a_transaction_commits_after_the_table_writes_it_covers_are_sent() -> None:
    flush_before_transaction_commit()
    flush_before_transaction_commit()  # idempotent: wrapped once
    producer = _Producer()
    app = SimpleNamespace(
        conf=SimpleNamespace(id="kvgate-worker"),
        assignor=SimpleNamespace(group_for_topic=lambda topic: 0),
        producer=producer,
    )
    tm = TransactionManager(SimpleNamespace(app=app), consumer=None, producer=producer)  # type: ignore[arg-type]
    assert await tm.commit({TP("kvgate.kv-events", 0): 42})
    # the commit saw both writes on their way: a crash after it cannot lose them
    assert producer.committed_with == [["changelog write 1", "changelog write 2"]]
    assert getattr(TransactionManager.commit, "flushes_first", False)
