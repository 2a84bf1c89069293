"""The worker's input, folded in offset order against Faust's consumer (the rules are in
:mod:`streams.frontier`): which records to fold, holes read again, partitions gone quiet short of
what was handed out read again, and the offsets a commit carries
(:func:`streams.faustpatch.commit_folded_offsets` reads them through ``app.folded_offsets``)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from streams.frontier import Frontier, Verdict
from streams.kafka import OffsetProbe
from streams.settings import KafkaSettings

__all__ = ["OrderedInput"]

log = logging.getLogger(__name__)


class OrderedInput:
    """One per worker app; ``topics`` are its input topics, ``counts["reread"]`` counts the
    times a partition was read again (exported by the worker's ``/metrics``)."""

    def __init__(
        self,
        app: Any,
        kafka: KafkaSettings,
        read_committed: bool,
        topics: set[str],
        counts: Counter[str],
    ) -> None:
        self.app = app
        self.topics = topics
        self.counts = counts
        self.frontier: Frontier[Any] = Frontier()
        self.probe = OffsetProbe(kafka, f"{app.conf.id}-offset-probe", read_committed)
        app.folded_offsets = self.folded_offsets

    def folded_offsets(self) -> tuple[set[str], dict[Any, int]]:
        return self.topics, self.frontier.offsets()

    def reset(self) -> None:
        """After a rebalance: every partition starts again from its committed offset."""
        self.frontier.reset()

    async def admit(self, msg: Any) -> bool:
        """Whether to fold the Faust message ``msg``: the next record of its partition. A record
        past a hole is dropped and the partition read again from the hole (or the hole stepped
        over when the broker holds no record there)."""
        consumer = self.app.consumer
        committed = consumer._committed_offset.get(msg.tp)
        verdict = self.frontier.observe(msg.tp, msg.offset, committed, time.monotonic())
        if verdict is not Verdict.HOLE:
            return verdict is Verdict.FOLD
        hole = self.frontier.next_offset(msg.tp)
        assert hole is not None
        first = await self.probe.first_offset(msg.tp.topic, msg.tp.partition, hole)
        fold, again = self.frontier.resolve(msg.tp, msg.offset, first)
        if again is not None:
            await self._read_again(
                msg.tp, again, f"records were not delivered (next: {msg.offset})"
            )
        return fold

    async def reread_quiet(self) -> None:
        """A record never delivered at the end of a partition has no later record to reveal it
        as a hole: a partition Faust's fetcher handed out past what was folded (its read offset),
        and from which nothing arrived for a while, is read again. One merely behind has handed
        nothing out past it."""
        consumer = self.app.consumer
        if self.app.rebalancing:
            return
        now = time.monotonic()
        assigned = {tp for tp in consumer.assignment() if tp.topic in self.topics}
        for tp in assigned:
            committed = consumer._committed_offset.get(tp)
            if committed is not None:
                self.frontier.track(tp, committed, now)
        read = consumer._read_offset
        ends = {}
        for tp in self.frontier.offsets():
            last = read.get(tp) if tp in assigned else None
            ends[tp] = None if last is None else last + 1
        for tp, offset in self.frontier.quiet(now, ends):
            first = await self.probe.first_offset(tp.topic, tp.partition, offset)
            if first is None:  # nothing there (markers at the end), or no answer: ask later
                continue
            again = self.frontier.step_to(tp, first)
            await self._read_again(tp, again, f"nothing arrived, handed out up to {ends[tp]}")

    async def _read_again(self, tp: Any, offset: int, why: str) -> None:
        self.counts["reread"] += 1
        log.warning("%s[%d]: reading again from offset %d: %s", tp.topic, tp.partition, offset, why)
        await self.app.consumer.seek(tp, offset)

    async def stop(self) -> None:
        await self.probe.stop()
