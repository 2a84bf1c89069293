"""The worker folds each input partition in offset order and commits what it folded
(streams.frontier, streams.faustpatch.commit_folded_offsets): a record Faust never delivered is
read again, records that do not exist are stepped over, and Faust's acknowledgement of a record no
agent folded does not reach the commit."""

from __future__ import annotations

import random
from collections import defaultdict

from faust.transport.drivers.aiokafka import Consumer
from faust.types import TP
from hypothesis import given, settings
from hypothesis import strategies as st
from intervaltree import IntervalTree

from streams.faustpatch import commit_folded_offsets
from streams.frontier import Frontier, Verdict

P = TP("kv-events", 0)


def test_records_in_order_are_folded_and_duplicates_are_not() -> None:
    f: Frontier[TP] = Frontier()
    assert f.observe(P, 40, 40, 0.0) is Verdict.FOLD
    assert f.observe(P, 41, 40, 0.0) is Verdict.FOLD
    assert f.observe(P, 40, 40, 0.0) is Verdict.SKIP  # delivered again
    assert f.offsets() == {P: 42}


def test_a_partition_never_committed_starts_at_its_first_record() -> None:
    f: Frontier[TP] = Frontier()
    assert f.observe(P, 7, None, 0.0) is Verdict.FOLD
    assert f.offsets() == {P: 8}


def test_a_hole_is_reported_once_then_again_after_the_retry_interval() -> None:
    f: Frontier[TP] = Frontier(retry_s=2.0)
    assert f.observe(P, 10, 10, 0.0) is Verdict.FOLD
    assert f.observe(P, 12, 10, 0.0) is Verdict.HOLE  # 11 never came
    assert f.resolve(P, 12, first=11) == (False, 11)  # it exists: read again from 11
    assert f.observe(P, 13, 10, 1.0) is Verdict.SKIP  # fetched before the re-read: dropped
    assert f.observe(P, 14, 10, 2.5) is Verdict.HOLE  # the re-read did not take: again
    assert f.offsets() == {P: 11}  # never past the hole
    assert f.observe(P, 11, 10, 3.0) is Verdict.FOLD
    assert f.observe(P, 12, 10, 3.0) is Verdict.FOLD
    assert f.offsets() == {P: 13}


def test_records_that_do_not_exist_are_stepped_over() -> None:
    f: Frontier[TP] = Frontier()
    assert f.observe(P, 5, 5, 0.0) is Verdict.FOLD
    # 6 is a transaction marker: the broker's first record from 6 is the one delivered
    assert f.observe(P, 7, 5, 0.0) is Verdict.HOLE
    assert f.resolve(P, 7, first=7) == (True, None)
    assert f.offsets() == {P: 8}
    # 9, 10 do not exist but 11 does, and 12 came: read again from 11
    assert f.observe(P, 12, 5, 0.0) is Verdict.HOLE
    assert f.resolve(P, 12, first=11) == (False, 11)
    assert f.offsets() == {P: 11}


def test_a_broker_that_cannot_answer_means_reading_again() -> None:
    f: Frontier[TP] = Frontier()
    f.observe(P, 0, 0, 0.0)
    assert f.observe(P, 3, 0, 0.0) is Verdict.HOLE
    assert f.resolve(P, 3, first=None) == (False, 1)


def test_a_partition_quiet_short_of_its_end_is_read_again() -> None:
    f: Frontier[TP] = Frontier(retry_s=2.0)
    f.observe(P, 0, 0, 0.0)
    assert f.quiet(1.0, {P: 2}) == []  # not quiet for long enough yet
    assert f.quiet(2.5, {P: 1}) == []  # everything up to the end was folded
    assert f.quiet(2.5, {P: 3}) == [(P, 1)]  # 1 and 2 never came
    assert f.quiet(3.0, {P: 3}) == []  # asked already
    assert f.step_to(P, 2) == 2  # the broker's first record from 1 is at 2
    assert f.offsets() == {P: 2}


def test_reset_starts_every_partition_again_from_its_committed_offset() -> None:
    f: Frontier[TP] = Frontier()
    f.observe(P, 0, 0, 0.0)
    f.reset()
    assert f.offsets() == {}
    assert f.observe(P, 30, 20, 0.0) is Verdict.HOLE  # committed 20: 20..29 not delivered
    assert f.observe(P, 19, 20, 0.0) is Verdict.SKIP


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 60),
    missing=st.sets(st.integers(0, 59)),
    seed=st.integers(0, 2**32),
    skip_p=st.sampled_from([0.0, 0.1, 0.3]),
)
def test_every_existing_record_is_folded_once_in_order(
    n: int, missing: set[int], seed: int, skip_p: float
) -> None:
    """A partition whose offsets have holes that exist (markers, aborted records) and a delivery
    that drops records, delivers some twice and keeps delivering records fetched before a
    re-read: the records folded are exactly the existing ones, in order, each once."""
    rng = random.Random(seed)
    log = [o for o in range(n) if o not in missing]
    if not log:
        return
    f: Frontier[TP] = Frontier(retry_s=3.0)
    folded: list[int] = []
    stale: list[int] = []  # fetched before the last re-read, still to be delivered
    pos = 0  # index into ``log`` of the next record the fetcher delivers
    now = 0.0
    for _ in range(20 * n + 200):
        now += 1.0
        if stale:
            offset = stale.pop(0)
        elif pos < len(log):
            offset = log[pos]
            pos += 1
            if rng.random() < skip_p:  # Faust skips it (and would have acked it)
                continue
            if rng.random() < 0.1:
                stale.append(offset)  # delivered twice
        else:  # nothing more arrives: the worker's timer asks about a partition gone quiet
            f.track(P, log[0], now)
            for tp, hole in f.quiet(now, {P: log[-1] + 1}):
                first = next((o for o in log if o >= hole), None)
                assert first is not None
                pos = log.index(f.step_to(tp, first))
            if f.offsets().get(P) == log[-1] + 1:
                break
            continue
        verdict = f.observe(P, offset, log[0], now)
        if verdict is Verdict.HOLE:
            hole = f.next_offset(P)
            assert hole is not None
            first = next((o for o in log if o >= hole), None)
            fold, again = f.resolve(P, offset, first)
            if again is not None:
                stale = [o for o in log[pos : pos + rng.randint(0, 3)]]  # already fetched
                pos = next(i for i, o in enumerate(log) if o >= again)
            verdict = Verdict.FOLD if fold else Verdict.SKIP
        if verdict is Verdict.FOLD:
            folded.append(offset)
        # never past a record not folded
        assert all(o in folded for o in log if o < f.offsets()[P])
    assert folded == log


def _consumer(committed: int) -> Consumer:
    """Faust's Kafka consumer with only the state its offset bookkeeping reads."""
    consumer = Consumer.__new__(Consumer)
    consumer._acked = defaultdict(list)
    consumer._acked_index = defaultdict(set)
    consumer._gap = defaultdict(IntervalTree)
    consumer._committed_offset = defaultdict(lambda: None)
    consumer._committed_offset[P] = committed
    return consumer


def test_commits_carry_what_was_folded_not_what_faust_acked() -> None:
    commit_folded_offsets()
    commit_folded_offsets()  # idempotent
    consumer = _consumer(committed=10)
    other = TP("elsewhere", 0)
    consumer._committed_offset[other] = 0
    # Faust acked 10..20, including 15, which a stream skipped during a rebalance
    for offset in range(10, 21):
        consumer._acked[P].append(offset)
        consumer._acked_index[P].add(offset)
    consumer._acked[other] = [0, 1, 2]
    consumer._acked_index[other] = {0, 1, 2}

    class _App:
        @staticmethod
        def folded_offsets() -> tuple[set[str], dict[TP, int]]:
            return {"kv-events"}, {P: 15}

    consumer.app = _App()  # type: ignore[assignment]
    offsets = consumer._filter_committable_offsets([P, other])
    # the input commits up to the record not folded; other topics keep Faust's offsets
    assert offsets == {P: 15, other: 3}
    assert consumer._acked[P] == []  # Faust's list was consumed and stays bounded

    # nothing new folded: nothing to commit for the input
    consumer._committed_offset[P] = 15
    assert consumer._filter_committable_offsets([P]) == {}


def test_an_app_without_folded_offsets_commits_as_faust_does() -> None:
    commit_folded_offsets()
    consumer = _consumer(committed=0)
    consumer._acked[P] = [0, 1, 2, 4]
    consumer._acked_index[P] = {0, 1, 2, 4}
    consumer.app = object()  # type: ignore[assignment]
    assert consumer._filter_committable_offsets([P]) == {P: 3}
