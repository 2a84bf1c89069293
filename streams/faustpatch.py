"""Changes to faust-streaming 0.15.3 (pinned) that the worker needs, each one idempotent.

* :func:`write_tables_before_commit`: the worker's coalesced table writes happen right before
  each commit of input offsets.
* :func:`flush_before_transaction_commit`: an exactly-once commit carries the table writes it
  covers.
* :func:`restore_only_settled_changelogs`: recovery reads every committed changelog record.
* :func:`allow_commit_bursts`: the producer buffer takes a commit's table writes at once.
* :func:`dispatch_without_tasks`: handing a fetched record to its stream costs no asyncio tasks.
* :func:`commit_folded_offsets`: commits carry the input offsets the agents folded, not the ones
  Faust acknowledged.
* :func:`fold_input_inline`: records of the topics an app folds itself go straight to its fold,
  past Faust's channels, streams, events and acknowledgements.
* :func:`send_table_records`: a commit's table records go out as one record batch per changelog
  partition, in that partition's transaction.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import logging
import time
from collections.abc import Coroutine
from typing import Any

from streams.settings import KafkaSettings

__all__ = [
    "FOLDED",
    "UnsentTableWrite",
    "allow_commit_bursts",
    "buffered_records_sent",
    "commit_folded_offsets",
    "dispatch_without_tasks",
    "flush_before_transaction_commit",
    "fold_input_inline",
    "restore_only_settled_changelogs",
    "send_table_records",
    "table_records_sent",
    "write_tables_before_commit",
]

log = logging.getLogger(__name__)
FOLDED = object()  # what a record handed to an inline fold returns to the consumer's dispatch


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


def restore_only_settled_changelogs(kafka: KafkaSettings, timeout_s: float = 10.0) -> None:
    """Make Faust's table recovery read every committed changelog record.

    With exactly-once the worker reads changelogs ``read_committed``, and Faust takes the
    partitions' end offsets at the start of recovery as the point where the tables are restored.
    For a ``read_committed`` reader that end is the *last stable offset*: it stops at the first
    transaction still open. A worker that just committed its last transaction and stopped
    (SIGTERM) leaves that transaction committed at the coordinator but its markers not yet
    written to every partition; the input offsets it committed are visible a moment before its
    table writes are. A successor that restores in that moment stops short of the writes yet
    resumes the input after them: the writes are never folded again (a KV cursor behind its
    input, blocks whose removals were committed still in the index). This waits, before
    recovery reads the end offsets, until no transaction is open on the changelog partitions
    this worker was newly given (the last stable offset equals the high watermark; on the
    partitions it kept, an open transaction is its own and would never settle). Open
    transactions of a dead worker are aborted when this worker's transactional producers start,
    which Faust does before recovery, so the wait is short (commit markers take milliseconds); it
    gives up after ``timeout_s`` (recovery then proceeds as before, and says so). Idempotent."""
    from faust.tables.recovery import Recovery

    build = Recovery._build_highwaters
    if getattr(build, "waits_for_settled", False):
        return

    owned: dict[tuple[int, str], set[Any]] = {}  # (recovery, title) -> partitions last time

    async def settled_highwaters(
        self: Recovery, consumer: Any, tps: Any, destination: Any, title: str
    ) -> None:
        # only partitions this worker did not hold at its previous recovery can have someone
        # else's transaction open; on the ones it kept, an open transaction is its own
        before = owned.get((id(self), title), set())
        new = set(tps) - before
        if new:
            await changelogs_settled(kafka, consumer, new, timeout_s)
        owned[(id(self), title)] = set(tps)
        await build(self, consumer, tps, destination, title)

    settled_highwaters.waits_for_settled = True  # type: ignore[attr-defined]
    Recovery._build_highwaters = settled_highwaters  # type: ignore[method-assign]


async def changelogs_settled(
    kafka: KafkaSettings, consumer: Any, tps: set[Any], timeout_s: float
) -> None:
    """Wait until ``consumer``'s (read_committed) end offsets of ``tps`` reach their high
    watermarks (see :func:`restore_only_settled_changelogs`)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    probe = AIOKafkaConsumer(
        **kafka.client_options(),
        client_id="kvgate-worker-recovery-probe",
        isolation_level="read_uncommitted",
        enable_auto_commit=False,
    )
    deadline = time.monotonic() + timeout_s
    try:
        await probe.start()
        unsettled: list[Any] = []
        while True:
            stable = await consumer.highwaters(*tps)
            ends = await probe.end_offsets([TopicPartition(tp.topic, tp.partition) for tp in tps])
            unsettled = [
                tp
                for tp in tps
                if (stable.get(tp) or 0) < ends.get(TopicPartition(tp.topic, tp.partition), 0)
            ]
            if not unsettled or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        if unsettled:
            log.warning(
                "changelog partitions still have open transactions after %.0f s, restoring "
                "what is committed: %s",
                timeout_s,
                ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(unsettled)),
            )
    except Exception as exc:  # the probe is a safeguard: recovery goes on without it
        log.warning("could not compare changelog end offsets before recovery: %s", exc)
    finally:
        await probe.stop()


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
    sent then with :func:`send_table_records`, and the commit waits until Kafka has them. An app
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
        return await commit_tps(self, tps, start_new_transaction)

    async def waiting_commit_offsets(
        self: Consumer, offsets: Any, start_new_transaction: bool = True
    ) -> bool:
        if getattr(self.app, "before_commit", None) is None:
            return bool(await commit_offsets(self, offsets, start_new_transaction))
        started = time.perf_counter()
        outbox = getattr(self.app, "table_outbox", None)
        if outbox:
            records, outbox[:] = list(outbox), []
            await table_records_sent(await send_table_records(self.app, records), timeout_s)
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


def dispatch_without_tasks() -> None:
    """Hand each fetched record to its stream without four asyncio tasks per record.

    Faust's consumer dispatches every record with ``wait_first(callback(record),
    suspend_flow.wait())``: a task for the callback, one for the flow guard and one each for the
    consumer's stopped and crashed events, then ``asyncio.wait`` and three cancellations. That
    costs more than the worker's own fold of the record. The callback (put the record in its
    stream's buffer) almost never has to wait, so this runs its first step at once, in a copy of
    the context as a task would: when it finishes there, nothing else is created. Only when it
    has to wait (a full stream buffer, a producer buffer over its limit) does the rest of it
    become a task, and Faust's own ``wait_first`` then waits for it against the flow guard as
    before, so a rebalance still interrupts a dispatch that waits. The consumer calls
    ``wait_first`` for nothing else."""
    from faust.transport.consumer import Consumer
    from mode import Service

    if getattr(Consumer.wait_first, "dispatches_inline", False):
        return

    async def inline_wait_first(self: Any, *coros: Any, timeout: Any = None) -> Any:  # noqa: ASYNC109 - Faust's signature
        if timeout is not None or len(coros) != 2 or not asyncio.iscoroutine(coros[0]):
            return await Service.wait_first(self, *coros, timeout=timeout)
        work, guard = coros
        ctx = contextvars.copy_context()
        try:
            waiting_on = ctx.run(work.send, None)
        except StopIteration as done:
            if asyncio.iscoroutine(guard):
                guard.close()
            if done.value is FOLDED:  # folded already (fold_input_inline): no stream to wait for
                return None
            # give way once, as Faust's dispatch did: the stream's agent takes the record now,
            # so records do not pile up in stream buffers that a rebalance clears (Faust then
            # counts a cleared record as read, and a later fetch past it as a gap it skips)
            await asyncio.sleep(0)
            return None
        except BaseException:
            if asyncio.iscoroutine(guard):
                guard.close()
            raise
        rest = asyncio.get_running_loop().create_task(_resume(work, waiting_on), context=ctx)
        return await Service.wait_first(self, rest, guard)

    inline_wait_first.dispatches_inline = True  # type: ignore[attr-defined]
    Consumer.wait_first = inline_wait_first  # type: ignore[method-assign]


async def _resume(coro: Coroutine[Any, Any, Any], waiting_on: Any) -> Any:
    """Drive a coroutine that was stepped by hand and is now waiting on ``waiting_on`` (what
    its last step yielded: a future, or None to give way to the loop) to its end."""
    while True:
        try:
            if waiting_on is None:
                await asyncio.sleep(0)
            else:
                waiting_on._asyncio_future_blocking = False  # as a task does with what it awaits
                try:
                    await asyncio.wait([waiting_on])
                except asyncio.CancelledError:
                    if not waiting_on.done():
                        waiting_on.cancel()
                    raise
            waiting_on = coro.send(None)
        except StopIteration as done:
            return done.value
        except asyncio.CancelledError as exc:
            try:
                waiting_on = coro.throw(exc)
            except StopIteration as done:
                return done.value


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


def commit_folded_offsets() -> None:
    """Commit, for the input topics an app names, the offsets its agents folded in order.

    An app that sets ``folded_offsets`` (a callable returning the input topic names and, per
    partition, the next offset not folded; see :mod:`streams.frontier`) has those offsets
    committed for its input topics instead of the ones Faust derives from acknowledgements:
    Faust acknowledges records its streams skip around a rebalance and commits over offset jumps
    it takes for compaction gaps, and a commit past input the tables never folded loses it.
    Faust's own bookkeeping still runs (its acknowledgement lists are trimmed below what was
    committed, so they stay bounded). Other topics keep Faust's offsets. Idempotent."""
    from faust.transport.consumer import Consumer

    filter_offsets = Consumer._filter_committable_offsets
    if getattr(filter_offsets, "folded_only", False):
        return

    def folded_offsets(self: Consumer, tps: Any) -> dict[Any, int]:
        offsets: dict[Any, int] = filter_offsets(self, tps)
        source = getattr(self.app, "folded_offsets", None)
        if source is None:
            return offsets
        topics, folded = source()
        out = {tp: offset for tp, offset in offsets.items() if tp.topic not in topics}
        for tp, offset in folded.items():
            if self._should_commit(tp, offset):
                out[tp] = offset
            acked = self._acked.get(tp)
            if acked:  # kept sorted by Faust; what lies below a committed offset is settled
                acked.sort()
                below = bisect.bisect_left(acked, offset)
                if below:
                    self._acked_index[tp].difference_update(acked[:below])
                    del acked[:below]
        return out

    folded_offsets.folded_only = True  # type: ignore[attr-defined]
    Consumer._filter_committable_offsets = folded_offsets  # type: ignore[method-assign]


def fold_input_inline() -> None:
    """Hand each record of the topics an app folds itself straight to its fold.

    An app that sets ``inline_folds`` (input topic name -> ``async fold(message)``) has every
    record of those topics folded by the consumer's dispatch as soon as it is fetched, with the
    raw key and value of Faust's message: no channel decode, stream buffer, event, agent step or
    acknowledgement per record, which cost the worker several times its own fold. Offsets are
    what the fold says it folded (:func:`commit_folded_offsets`), so nothing is acknowledged.
    While Faust's flow is suspended (a rebalance) a fetched record is dropped unfolded, as
    Faust's streams drop it; the fold's offset frontier reads the partition again from where it
    stopped. The app's agents on those topics then never receive a record. Other topics (tables'
    changelogs during recovery, anything without a fold) go through Faust as before. Idempotent."""
    from faust.transport.conductor import Conductor

    compile_handler = Conductor._compile_message_handler
    if getattr(compile_handler, "folds_inline", False):
        return

    def compile_inline(self: Conductor) -> Any:
        deliver = compile_handler(self)
        app = self.app
        flow = app.flow_control

        async def on_message(message: Any) -> Any:
            folds = getattr(app, "inline_folds", None)
            fold = None if folds is None else folds.get(message.topic)
            if fold is None:
                return await deliver(message)
            if flow.is_active():
                await fold(message)
            return FOLDED

        return on_message

    compile_inline.folds_inline = True  # type: ignore[attr-defined]
    Conductor._compile_message_handler = compile_inline  # type: ignore[method-assign]


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
