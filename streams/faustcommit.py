"""Changes to faust-streaming 0.15.3 (pinned) on the worker's commit side, each one idempotent
(the input side: :mod:`streams.faustpatch`).

* :func:`write_tables_before_commit`: the worker's coalesced table writes happen right before
  each commit of input offsets, and the commit waits until Kafka has them.
* :func:`send_table_records`: a commit's table records go out as one record batch per changelog
  partition, in that partition's transaction.
* :func:`flush_before_transaction_commit`: an exactly-once commit carries the table writes it
  covers.
* :func:`allow_commit_bursts`: the producer buffer takes a commit's table writes at once.
* :func:`commit_transactions_together`: an exactly-once commit ends its partitions'
  transactions concurrently, not one after another.
* :func:`commit_on_a_fixed_cadence`: commits start every commit interval, however long the
  previous one took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

__all__ = [
    "UnsentTableWrite",
    "allow_commit_bursts",
    "buffered_records_sent",
    "commit_on_a_fixed_cadence",
    "commit_transactions_together",
    "flush_before_transaction_commit",
    "send_table_records",
    "table_records_sent",
    "write_tables_before_commit",
]

log = logging.getLogger(__name__)
_now = time.monotonic  # the commit cadence's clock (a test replaces it)


def flush_before_transaction_commit(timeout_s: float = 30.0) -> None:
    """Make Faust's exactly-once commits carry the table writes they cover.

    faust-streaming 0.15.3 commits a transaction (input offsets + end of transaction) without
    first draining its own producer buffer: ``Consumer._commit_offsets`` calls
    ``producer.flush()`` only outside transactions. Changelog records still in that buffer are
    sent after the commit, into the next transaction, so a worker that dies in between has
    committed input offsets whose table writes are lost. This waits, before each commit
    (periodic, rebalance and the final one at shutdown alike), until the record that was
    buffered last when the commit started has reached Kafka: the buffer is FIFO, so every record
    buffered before it has then been handed to aiokafka, which sends what it holds before it ends
    a transaction. Records buffered later belong to later offsets and go to the next transaction.
    (Faust's own ``flush()`` would wait for an empty buffer, which under steady table writes
    holds every commit back.)

    The record to wait for is remembered when it is buffered, not looked up in the buffer's
    queue: the buffer's sender takes a record off the queue *before* handing it to aiokafka
    (which can wait when a partition's batch is full), so a queue that looks empty may still have
    a record in flight. If that record fails or is not sent in time, the commit is refused (the
    worker stops and the input is folded again): committing would lose table writes. Idempotent.
    """
    from faust.transport.consumer import TransactionManager

    remember_last_buffered()

    commit = TransactionManager.commit
    if getattr(commit, "flushes_first", False):
        return

    async def flushed_commit(
        self: TransactionManager, offsets: Any, start_new_transaction: bool = True
    ) -> bool:
        await buffered_records_sent(self.app.producer, timeout_s)
        return await commit(self, offsets, start_new_transaction=start_new_transaction)

    flushed_commit.flushes_first = True  # type: ignore[attr-defined]
    TransactionManager.commit = flushed_commit  # type: ignore[method-assign]


def remember_last_buffered() -> None:
    """Have Faust's producer buffer remember the record put into it last (what
    :func:`buffered_records_sent` waits for). Idempotent."""
    from faust.transport.producer import ProducerBuffer

    put = ProducerBuffer.put
    if getattr(put, "remembers_last", False):
        return

    def remembering_put(self: ProducerBuffer, fut: Any) -> None:
        self.last_buffered = fut  # type: ignore[attr-defined]
        put(self, fut)

    remembering_put.remembers_last = True  # type: ignore[attr-defined]
    ProducerBuffer.put = remembering_put  # type: ignore[method-assign]


class UnsentTableWrite(RuntimeError):
    """A table write buffered before a commit was not sent: the commit must not happen."""


async def buffered_records_sent(producer: Any, timeout_s: float) -> None:
    """Wait until the record buffered last in ``producer`` has been sent (see above)."""
    if producer.app.conf.producer_threaded:  # another queue: drain the whole buffer
        await producer.flush()
        return
    last = getattr(producer.buffer, "last_buffered", None)
    if last is None:
        return
    if last.cancelled():
        raise UnsentTableWrite("a buffered table write was cancelled; not committing")
    await _sent_or_refuse(asyncio.shield(last), timeout_s, "a buffered table write")


async def _sent_or_refuse(sending: Any, timeout_s: float, what: str) -> None:
    """Wait for ``sending`` (table records on their way to Kafka); a commit must not happen
    when they fail or take longer than ``timeout_s``: :class:`UnsentTableWrite`."""
    try:
        await asyncio.wait_for(sending, timeout_s)
    except TimeoutError:
        raise UnsentTableWrite(
            f"{what} was not sent within {timeout_s:.0f} s; not committing"
        ) from None
    except Exception as exc:
        raise UnsentTableWrite(f"{what} failed; not committing: {exc}") from exc


def write_tables_before_commit(timeout_s: float = 30.0) -> None:
    """Call ``app.before_commit()`` (when an app sets one) before each commit of input offsets,
    in both processing modes, and wait until the records it buffered reached aiokafka. Records
    the hook leaves in ``app.table_outbox`` ((changelog topic, partition, key, value) tuples) are
    sent then with :func:`send_table_records`, and the commit waits until Kafka has them (when
    no offset moved, Faust commits nothing: they are sent right after all the same). An app
    that also sets ``commit_seconds`` (a dict) gets the time of each phase added to it: ``write``
    (the hook), ``send`` (the wait for its records), ``commit`` (Faust's commit of the offsets).

    The worker writes its coalesced table records there, so a commit always covers the writes
    of the input it commits. The wait matters in the default at-least-once mode too: Faust's
    ``producer.flush()`` before a plain offset commit drains its buffer only while records keep
    leaving it within 0.1 s each (``ProducerBuffer.flush_atmost``); on a loaded machine it
    returns with records still queued, the offsets are committed, and a worker killed then has
    lost table writes the input will not replay (the kill -9 fault test caught it). Records
    handed to aiokafka are then flushed by Faust (at-least-once) or sent before the transaction
    ends (exactly-once, :func:`flush_before_transaction_commit`). The offsets a commit carries
    are read right after the writes, with nothing folded in between. Idempotent."""
    from faust.transport.consumer import Consumer

    remember_last_buffered()
    commit_tps = Consumer._commit_tps
    if getattr(commit_tps, "writes_tables", False):
        return
    commit_offsets = Consumer._commit_offsets

    async def writing_commit_tps(self: Consumer, tps: Any, start_new_transaction: bool) -> bool:
        hook = getattr(self.app, "before_commit", None)
        if hook is not None:
            started = time.perf_counter()
            hook()
            _timed(self.app, "write", started)
        # no await between the writes and Faust reading the offsets to commit: an input record
        # folded after the writes (while a commit waits) must not be in this commit's offsets
        committed = await commit_tps(self, tps, start_new_transaction)
        # Faust commits nothing when no offset moved (idle input after a rebalance rewrote the
        # tables): the records are sent all the same, now, while their partitions are held
        await _send_outbox(self.app, timeout_s)
        return committed

    async def waiting_commit_offsets(
        self: Consumer, offsets: Any, start_new_transaction: bool = True
    ) -> bool:
        if getattr(self.app, "before_commit", None) is None:
            return bool(await commit_offsets(self, offsets, start_new_transaction))
        started = time.perf_counter()
        await _send_outbox(self.app, timeout_s)
        await buffered_records_sent(self.app.producer, timeout_s)
        started = _timed(self.app, "send", started)
        done = bool(await commit_offsets(self, offsets, start_new_transaction))
        _timed(self.app, "commit", started)
        return done

    writing_commit_tps.writes_tables = True  # type: ignore[attr-defined]
    Consumer._commit_tps = writing_commit_tps  # type: ignore[method-assign]
    Consumer._commit_offsets = waiting_commit_offsets  # type: ignore[method-assign]


def _timed(app: Any, phase: str, started: float) -> float:
    """Add the time since ``started`` to the app's ``commit_seconds`` (phase -> [sum, count,
    last]) when it keeps one; returns now."""
    now = time.perf_counter()
    stats = getattr(app, "commit_seconds", None)
    if stats is not None:
        entry = stats.setdefault(phase, [0.0, 0, 0.0])
        entry[0] += now - started
        entry[1] += 1
        entry[2] = now - started
    return now


def allow_commit_bursts(max_messages: int) -> None:
    """Let Faust's producer buffer hold ``max_messages`` records before it holds up the input.

    Faust stops dispatching input records while its producer buffer holds more than 100
    records (``ProducerBuffer.max_messages``), and then waits for the buffer record by record,
    logging a warning each time: a back-pressure meant for table writes made one per input
    record. The worker writes its tables in one burst per commit (one or two records per changed
    node: a thousand nodes, a few thousand records), which would trip it at every commit. The
    burst is bounded by the number of nodes and reservations, not by the input rate."""
    from faust.transport.producer import ProducerBuffer

    ProducerBuffer.max_messages = max(ProducerBuffer.max_messages, max_messages)


def commit_transactions_together() -> None:
    """End the transactions of one exactly-once commit concurrently.

    faust-streaming 0.15.3 keeps one transactional producer per input partition and commits
    them one after another: for each, the offsets go to the transaction (two requests), the
    transaction ends (one request, which waits for the broker to write its markers), a new one
    begins. With four partitions on a busy broker that took 80–350 ms per commit, during which
    nothing folded since the commit started can become visible, and the next commit starts only
    after it. The transactions are independent (one producer and one lock each; a crash between
    two of them leaves the same partial state either way), so they run side by side here; the
    first failure is raised once all have finished, as Faust's loop would raise it. Idempotent."""
    from faust.transport.drivers.aiokafka import Producer

    sequential = Producer.commit_transactions
    if getattr(sequential, "together", False):
        return

    async def one(
        self: Any, transactional_id: str, offsets: Any, group_id: str, start_new: bool
    ) -> None:
        async with self._trn_locks[transactional_id]:
            producer = self._transaction_producers.get(transactional_id)
            if producer is None:
                log.warning("Commit invoked for unknown transaction %s", transactional_id)
                return
            await producer.send_offsets_to_transaction(offsets, group_id)
            await producer.commit_transaction()
            if start_new:
                await producer.begin_transaction()

    async def together(
        self: Any,
        tid_to_offset_map: Any,
        group_id: str,
        start_new_transaction: bool = True,
    ) -> None:
        results = await asyncio.gather(
            *(
                one(self, tid, offsets, group_id, start_new_transaction)
                for tid, offsets in tid_to_offset_map.items()
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    together.together = True  # type: ignore[attr-defined]
    Producer.commit_transactions = together  # type: ignore[method-assign]


def commit_on_a_fixed_cadence() -> None:
    """Start a commit every commit interval, counted from the start of the previous one.

    Faust's commit timer sleeps a whole interval *after* each commit, so the period is the
    interval plus the commit's own duration, and a table write waits for both. Here the sleep is
    what is left of the interval (none when a commit took longer: the next starts right away).
    Idempotent."""
    from faust.transport.consumer import Consumer
    from mode.services import ServiceTask

    current = Consumer.__dict__.get("_commit_handler")
    if getattr(getattr(current, "fun", None), "fixed_cadence", False):
        return

    async def commit_handler(self: Consumer) -> None:
        interval = float(self.commit_interval)
        await self.sleep(interval)
        while not self.should_stop:
            started = _now()
            await self.commit()
            await self.sleep(max(0.0, interval - (_now() - started)))

    commit_handler.fixed_cadence = True  # type: ignore[attr-defined]
    Consumer._commit_handler = ServiceTask(commit_handler)  # type: ignore[method-assign]


async def _send_outbox(app: Any, timeout_s: float) -> None:
    """Send the records an app left in ``table_outbox`` and wait until Kafka has them."""
    outbox = getattr(app, "table_outbox", None)
    if outbox:
        records, outbox[:] = list(outbox), []
        await table_records_sent(await send_table_records(app, records), timeout_s)


async def send_table_records(
    app: Any, records: list[tuple[str, int, bytes, bytes | None]]
) -> list[asyncio.Future[Any]]:
    """Send table records ((changelog topic, partition, key, value); None deletes) as one record
    batch per changelog partition (more when one fills), through the producer that carries that
    partition's transaction with exactly-once (as Faust's own table writes go), or the app's
    producer; returns the batches' delivery futures.

    Faust sends a table write as one message through its producer buffer: a future, a buffer
    entry and a produce call each, about half a millisecond apiece on a loaded core. A commit
    that writes a thousand nodes' segments then spends most of a commit interval sending, and
    the tables fall behind by that much more. Here the records of one partition are appended to
    one batch builder (aiokafka's C record encoder) and handed over at once."""
    by_partition: dict[tuple[str, int], list[tuple[bytes, bytes | None]]] = {}
    for topic, partition, key, value in records:
        by_partition.setdefault((topic, partition), []).append((key, value))
    futures: list[asyncio.Future[Any]] = []
    for (topic, partition), items in by_partition.items():
        producer, lock = _table_producer(app, topic, partition)
        async with lock:
            batch = producer.create_batch()
            for key, value in items:
                if batch.append(key=key, value=value, timestamp=None) is not None:
                    continue
                futures.append(await producer.send_batch(batch, topic, partition=partition))
                batch = producer.create_batch()
                if batch.append(key=key, value=value, timestamp=None) is None:
                    raise UnsentTableWrite(f"a {topic} record is larger than a producer batch")
            futures.append(await producer.send_batch(batch, topic, partition=partition))
    return futures


def _table_producer(app: Any, topic: str, partition: int) -> tuple[Any, Any]:
    """The aiokafka producer (and the lock Faust holds while sending with it) that carries
    writes to ``topic``'s ``partition``."""
    if not app.in_transaction:
        return app.producer._ensure_producer(), contextlib.nullcontext()
    driver = app.consumer.transactions.producer
    group = app.assignor.group_for_topic(topic)
    transactional_id = f"{app.conf.id}-{group}-{partition}"
    producer = driver._transaction_producers.get(transactional_id)
    if producer is None:
        raise UnsentTableWrite(f"no transaction is open for {topic}[{partition}]; not committing")
    return producer, driver._trn_locks[transactional_id]


async def table_records_sent(futures: list[asyncio.Future[Any]], timeout_s: float) -> None:
    """Wait until every batch of :func:`send_table_records` reached Kafka."""
    if futures:
        await _sent_or_refuse(asyncio.gather(*futures), timeout_s, "a batch of table records")
