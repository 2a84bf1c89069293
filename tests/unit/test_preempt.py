"""Fair under saturation, the pure rules: the queue's aging term (nothing waits forever behind a
higher class) and preemption of sheddable work before its first token."""

from __future__ import annotations

import math

from admission.core import RejectReason
from admission.preempt import Running, freed, make_room, preempted, victims
from admission.queue import AdmissionQueues, Waiting
from admission.settings import AdmissionSettings, Priority
from tests.unit.test_admission import budget

S = AdmissionSettings()  # queue_aging_s: 5 s


def w(rid: str, priority: Priority, at: float, blocks: int = 10, deadline: float = 60.0) -> Waiting:
    return Waiting(rid, "default", priority, blocks, at, deadline)


def test_a_request_counts_one_class_higher_for_every_aging_period_it_waited() -> None:
    q = AdmissionQueues(S)
    low = w("l", "low", 0.0)
    assert [q.rank(low, t) for t in (0.0, 4.9, 5.0, 9.9, 10.0, 100.0)] == [2, 2, 1, 1, 0, 0]
    assert q.rank(w("h", "high", 0.0), 100.0) == 0
    strict = AdmissionQueues(S.model_copy(update={"queue_aging_s": 0.0}))
    assert strict.rank(low, 100.0) == 2


def test_an_aged_request_passes_the_class_it_aged_into_but_never_its_natives() -> None:
    """A low request that waited two aging periods goes before normal ones (its place: high);
    a high request still goes before it (native to high), as before anything aged."""
    q = AdmissionQueues(S)
    room = budget(0)
    for item in (w("l", "low", 0.0), w("n", "normal", 6.0)):
        assert q.offer(item, room, item.enqueued_at) is None
    assert q.admissible("default", room, 9.0).request_id == "n"  # type: ignore[union-attr]
    assert q.admissible("default", room, 10.0).request_id == "l"  # type: ignore[union-attr]
    assert q.offer(w("h", "high", 10.0), room, 10.0) is None
    assert q.admissible("default", room, 11.0).request_id == "h"  # type: ignore[union-attr]
    strict = AdmissionQueues(S.model_copy(update={"queue_aging_s": 0.0}))
    for item in (w("l", "low", 0.0), w("n", "normal", 6.0)):
        strict.offer(item, room, item.enqueued_at)
    assert strict.admissible("default", room, 600.0).request_id == "n"  # type: ignore[union-attr]


def test_an_aged_request_may_fill_to_the_watermark_of_the_class_it_aged_into() -> None:
    """Under sustained load above red, a normal request would wait out its deadline with
    strict priority; aged into high it may fill to the whole budget."""
    q = AdmissionQueues(S)
    assert q.offer(w("n", "normal", 0.0), budget(950), 0.0) is None
    assert q.admissible("default", budget(950), 1.0) is None  # over red (90 %)
    assert q.admissible("default", budget(950), 5.0) is not None  # aged: high's limit


def test_a_newcomer_never_overtakes_a_request_aged_into_its_class() -> None:
    q = AdmissionQueues(S)
    q.offer(w("n", "normal", 0.0), budget(950), 0.0)
    assert not q.waiting_at_or_above("default", "high", 4.0)
    assert q.waiting_at_or_above("default", "high", 5.0)
    assert q.waiting_at_or_above("default", "normal", 0.0)


def run(rid: str, at: float, blocks: int = 100, priority: Priority = "low") -> Running:
    return Running(rid, priority, blocks, at)


def test_victims_are_the_newest_sheddable_requests_that_make_the_room() -> None:
    b = budget(950, drain=0.0)  # no drain seen: the wait is unknown, it would miss
    normal = w("n", "normal", 10.0, blocks=100, deadline=20.0)
    running = [run("old", 1.0), run("mid", 2.0), run("new", 3.0), run("hi", 4.0, priority="high")]
    # 950 + 100 - 900 = 150 blocks to free: the two newest low requests
    got = victims(normal, running, b, (0, 0), math.inf, 10.0, S)
    assert [r.request_id for r in got] == ["new", "mid"]
    assert freed(b, got).kv_blocks_reserved == 750
    # it would make its deadline: nobody is preempted
    assert victims(normal, running, b, (0, 0), 5.0, 10.0, S) == []
    # queued work ahead of it counts: more room is needed
    assert len(victims(normal, running, b, (100, 1), math.inf, 10.0, S)) == 3


def test_no_victims_when_they_cannot_make_the_room_or_are_not_below_it() -> None:
    b = budget(950, drain=0.0)
    normal = w("n", "normal", 10.0, blocks=100, deadline=20.0)
    assert victims(normal, [run("a", 1.0, blocks=50)], b, (0, 0), math.inf, 10.0, S) == []
    low = w("l", "low", 10.0, blocks=100, deadline=20.0)  # a low request never preempts a low one
    assert victims(low, [run("a", 1.0, blocks=500)], b, (0, 0), math.inf, 10.0, S) == []
    off = S.model_copy(update={"preemption": False})
    assert victims(normal, [run("a", 1.0, blocks=500)], b, (0, 0), math.inf, 10.0, off) == []
    wider = S.model_copy(update={"preempt_priorities": ["low", "normal"]})
    high = w("h", "high", 10.0, blocks=100, deadline=20.0)
    full = budget(1000, drain=0.0)
    got = victims(
        high, [run("a", 1.0, 200, priority="normal")], full, (0, 0), math.inf, 10.0, wider
    )
    assert [r.request_id for r in got] == ["a"]


def test_the_preempted_client_is_told_when_to_come_back() -> None:
    rej = preempted("high", 12.0, S)
    assert rej.reason == RejectReason.PREEMPTED and rej.retriable and rej.retry_after_s == 12.0
    assert preempted("high", math.inf, S).retry_after_s == S.max_retry_after_s


class Engines:
    """A Preemptible: what it was asked to end, and whether it still could."""

    def __init__(self, running: list[Running], answered: set[str] | None = None) -> None:
        self._running = running
        self.answered = answered or set()
        self.ended: list[str] = []

    def running(self, pool: str) -> list[Running]:
        return list(self._running)

    def preempt(self, request_id: str, rejection: object) -> bool:
        if request_id in self.answered:
            return False
        self.ended.append(request_id)
        return True


def test_make_room_preempts_and_counts_only_what_it_ended() -> None:
    q = AdmissionQueues(S)
    b = budget(950, drain=0.0)
    normal = w("n", "normal", 10.0, blocks=100, deadline=20.0)
    engines = Engines([run("a", 1.0), run("b", 2.0)], answered={"a"})
    after = make_room(q, normal, b, engines, 10.0)
    assert engines.ended == ["b"]  # a answered in the meantime: it stays
    assert after.kv_blocks_reserved == 850
    assert make_room(q, normal, b, None, 10.0) == b
