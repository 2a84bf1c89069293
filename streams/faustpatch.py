"""Changes to faust-streaming 0.15.3 (pinned) on the worker's input side, each one idempotent
(the commit side: :mod:`streams.faustcommit`).

* :func:`restore_only_settled_changelogs`: recovery reads every committed changelog record.
* :func:`dispatch_without_tasks`: handing a fetched record to its stream costs no asyncio tasks.
* :func:`commit_folded_offsets`: commits carry the input offsets the agents folded, not the ones
  Faust acknowledged.
* :func:`fold_input_inline`: records of the topics an app folds itself go straight to its fold,
  past Faust's channels, streams, events and acknowledgements.
* :func:`set_fetch_wait`: a fetch for idle partitions does not hold up the busy ones.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import logging
import time
from collections.abc import Coroutine
from typing import Any

from streams.settings import KafkaSettings

__all__ = [
    "FAUST_FETCH_WAIT_MS",
    "FOLDED",
    "aiokafka_consumer",
    "commit_folded_offsets",
    "dispatch_without_tasks",
    "fold_input_inline",
    "restore_only_settled_changelogs",
    "set_fetch_wait",
]

log = logging.getLogger(__name__)
FOLDED = object()  # what a record handed to an inline fold returns to the consumer's dispatch


FAUST_FETCH_WAIT_MS = 1_500  # the fetch wait Faust gives the worker's consumer


def aiokafka_consumer(app: Any) -> Any:
    """The aiokafka consumer under Faust ``app``'s consumer thread (None before it runs)."""
    return getattr(getattr(app.consumer, "_thread", None), "_consumer", None)


def set_fetch_wait(app: Any, wait_ms: int) -> bool:
    """Make the worker's consumer wait at most ``wait_ms`` in its next fetches; False when it
    has no running consumer yet.

    aiokafka sends one fetch at a time to a broker, for the assigned partitions whose fetched
    records have all been handed over; partitions still holding records are left out. Under
    load the busy inputs (KV events, heartbeats) usually still hold records when the next fetch
    goes out, so that fetch asks only for the idle ones (the reservation ledger), and the broker
    holds it for the whole wait with nothing to return. Until it answers no fetch for the busy
    partitions can go to that broker: with Faust's 1,500 ms the worker stopped folding for up to
    1.5 s at a time at 1,000 nodes. The worker shortens the wait once it folds input and gives
    Faust's back when a rebalance starts: with short waits during the recovery of partitions
    another worker just gave up, the recovery waited out its settle timeout (10 s without
    folding, measured with two workers)."""
    fetcher = getattr(aiokafka_consumer(app), "_fetcher", None)
    if fetcher is None:
        return False
    fetcher._fetch_max_wait_ms = wait_ms  # read by each fetch request it builds
    return True


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
