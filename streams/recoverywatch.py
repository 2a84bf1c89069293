"""Table recovery that waits for changelog records Faust fetched and dropped.

Faust restores a table by seeking each changelog partition the worker was given and waiting
until the records up to the end offsets it took at the start have arrived. Around a rebalance
its consumer drops records it has fetched: a batch that returns while the flow is stopped, or
after the consumer generation changed, is discarded, and Faust then seeks back only the
partitions that have committed offsets, which changelogs never have. The consumer's position
stands at the end of the changelog while recovery still waits for its first record. At
least once, the worker then folds nothing until it is restarted (seen with a worker taking over
the partitions of one killed -9: recovery waited for minutes, the position at the changelog's
end); exactly once, Faust takes the missing records for aborted transactions after 10 s and
goes on from tables that lack them.

:class:`RecoveryWatch` finds such a partition: recovery still short of its end, nothing of it
arrived for ``quiet_s``, and the consumer's position past what recovery received (a partition
merely slow to fetch has handed nothing out past it). The worker asks the broker for the first
record after what recovery received (with exactly-once a changelog ends in commit markers, which
recovery never receives and Faust steps over itself) and, where there is one, reads the
partition again from it; a record received twice is applied once (recovery keeps the last
offset it applied). The input partitions have the same guard in
:mod:`streams.frontier`."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from streams.faustpatch import aiokafka_consumer
from streams.kafka import OffsetProbe

__all__ = ["RecoveryWatch", "Restoring", "reread_lost_changelogs"]

log = logging.getLogger(__name__)
TP = TypeVar("TP")


@dataclass(frozen=True, slots=True)
class Restoring:
    """One changelog partition under recovery."""

    received: int  # the last offset recovery has (its start offset before any arrived; -1: none)
    end: int  # the last offset it waits for
    position: int | None  # the consumer's next fetch offset (None: not known yet)


class RecoveryWatch(Generic[TP]):
    """Which changelog partitions recovery waits for in vain, and where to read them again."""

    def __init__(self, quiet_s: float = 5.0) -> None:
        self.quiet_s = quiet_s
        self._since: dict[TP, tuple[int, float]] = {}  # tp -> (received, since when unchanged)

    def check(self, now: float, parts: Mapping[TP, Restoring]) -> dict[TP, int]:
        """The partitions to read again, each with the offset to read from. Call it while a
        recovery runs with every partition it restores; a partition read again waits another
        ``quiet_s`` before it can be named again."""
        since: dict[TP, tuple[int, float]] = {}
        again: dict[TP, int] = {}
        for tp, part in parts.items():
            if part.received >= part.end:
                continue  # restored
            last = self._since.get(tp)
            if last is None or last[0] != part.received:
                since[tp] = (part.received, now)  # records arrive: not stalled
                continue
            since[tp] = last
            handed_out = part.position is not None and part.position > part.received + 1
            if now - last[1] >= self.quiet_s and handed_out:
                again[tp] = part.received + 1
                since[tp] = (part.received, now)
        self._since = since
        return again


def _positions(app: Any, tps: set[Any]) -> dict[Any, int]:
    """The consumer's fetch positions of ``tps`` (read from its aiokafka consumer's state)."""
    subscription = getattr(
        getattr(aiokafka_consumer(app), "_subscription", None), "subscription", None
    )
    assignment = getattr(subscription, "assignment", None)
    if assignment is None:
        return {}
    states = {tp: assignment.state_value(tp) for tp in tps}  # None: not assigned
    return {
        tp: st.position for tp, st in states.items() if st is not None and st.has_valid_position
    }


async def reread_lost_changelogs(
    app: Any, watch: RecoveryWatch[Any], probe: OffsetProbe, counts: Counter[str]
) -> None:
    """One look at the running recovery of Faust ``app`` (the worker's watch calls it every
    second): every changelog partition whose records were handed out and never arrived is read
    again (``counts["recovery_reread"]``)."""
    try:
        await _reread_lost(app, watch, probe, counts)
    except Exception:  # a safeguard: it must never stop the worker
        log.exception("could not check the table recovery")


async def _reread_lost(
    app: Any, watch: RecoveryWatch[Any], probe: OffsetProbe, counts: Counter[str]
) -> None:
    recovery = app.tables.recovery
    if not recovery.in_recovery or app.tables.changelog_queue.qsize():
        watch.check(time.monotonic(), {})  # records queued for recovery: it is not stalled
        return
    tps = set(recovery.active_tps)
    positions = _positions(app, tps)
    parts: dict[Any, Restoring] = {}
    for tp in tps:
        received, end = recovery.active_offsets.get(tp), recovery.active_highwaters.get(tp)
        if end is None:
            continue  # Faust does not wait for it either
        parts[tp] = Restoring(
            received=-1 if received is None else received, end=end, position=positions.get(tp)
        )
    again: dict[Any, int] = {}
    for tp, offset in watch.check(time.monotonic(), parts).items():
        first = await probe.first_offset(tp.topic, tp.partition, offset)
        if first is None or first > parts[tp].end:
            continue  # no record there (markers), or no answer: asked again after quiet_s
        again[tp] = first
        counts["recovery_reread"] += 1
        log.warning(
            "%s[%d]: recovery received up to offset %d while the consumer is at %d; reading "
            "again from %d",
            tp.topic,
            tp.partition,
            parts[tp].received,
            parts[tp].position,
            first,
        )
    if again:
        await app.consumer.seek_wait(again)
