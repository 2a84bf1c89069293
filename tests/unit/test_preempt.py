"""Fair under saturation, the pure rules: the queue's aging term (nothing waits forever behind a
higher class) and preemption of sheddable work before its first token."""

from __future__ import annotations

import math
from dataclasses import replace

from admission.core import RejectReason
from admission.preempt import Running, deadline_victims, freed, make_room, preempted, victims
from admission.queue import AdmissionQueues, Waiting
from admission.settings import DEFAULT_SLO_CLASSES, AdmissionSettings, Priority
from agents.profile import EngineProfile
from analytics.sim.simcore import SimCore, SimSeq
from router.decision.fleet import Fleet
from router.decision.inflight import InflightLedger
from router.decision.pipeline import Ask, Refused, Routed, Rules, Snapshot, commit, decide
from router.decision.policies import make_policy
from router.decision.types import RouteRequest
from router.decision.weights import OutlierSettings, SlowStartSettings
from router.settings import RouterSettings
from tests.factories import NOW, node_view
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

    def on_node(self, node: str) -> list[Running]:
        return [r for r in self._running if r.node == node]

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


def on(rid: str, at: float, tokens: int, priority: Priority = "low") -> Running:
    return Running(rid, priority, 50, at, "a", tokens)


def test_deadline_victims_save_the_time_the_request_would_be_late() -> None:
    queued = [on("old", 1.0, 3000), on("mid", 2.0, 1000), on("new", 3.0, 1000)]
    # 1.5 s late at 1,000 tokens/s: the two newest (2 s of prefill) make it
    got = deadline_victims("high", 1.5, 1000.0, queued, S)
    assert [r.request_id for r in got] == ["new", "mid"]
    assert deadline_victims("high", 0.0, 1000.0, queued, S) == []  # on time
    assert deadline_victims("high", 9.0, 1000.0, queued, S) == []  # even all would not do
    assert deadline_victims("high", 1.5, None, queued, S) == []  # the node's rate unknown
    assert deadline_victims("low", 1.5, 1000.0, queued, S) == []  # not for its own class
    off = S.model_copy(update={"preemption": False})
    assert deadline_victims("high", 1.5, 1000.0, queued, off) == []


def test_routing_preempts_the_sheddable_work_that_makes_a_request_late_on_its_node() -> None:
    """Its best node has 5 s of prefill queued (1,000 tokens/s), the interactive class wants
    its first token within 2 s: refused early — unless low requests not answered yet on that
    node hold enough of that queue; then it is routed, naming them to preempt, and they are
    ended when it is committed (sent), not when it is only decided."""
    rules = Rules(
        make_policy(RouterSettings(policy="kvgate")),
        Fleet(OutlierSettings(enabled=False), SlowStartSettings(window_s=0)),
        S,
    )
    node = node_view("a", prefill_tokens_per_s=1000.0, prefill_backlog_tokens=5000)
    req = RouteRequest("r1", "m", list(range(1, 11)), 160, 16, None)
    slo = ("interactive", DEFAULT_SLO_CLASSES["interactive"])
    ask = Ask(req, 16, NOW, slo, priority="high")
    queued = [on("l1", NOW - 3, 3000), on("l2", NOW - 2, 2000), on("l3", NOW - 1, 1000)]

    def snap(engines: Engines | None) -> Snapshot:
        return Snapshot([node], {}, NOW, 16, preemptible=engines)

    assert isinstance(decide(ask, snap(None), rules), Refused)  # (a dry run: nobody to ask)
    engines = Engines([*queued, Running("elsewhere", "low", 50, NOW, "b", 9000)])
    got = decide(ask, snap(engines), rules)
    assert isinstance(got, Routed) and got.decision.chosen == "a"
    assert [r.request_id for r in got.preempt] == ["l3", "l2", "l1"][: len(got.preempt)]
    assert sum(r.prefill_tokens for r in got.preempt) >= 3000
    assert engines.ended == []  # deciding ends nothing
    commit(ask, snap(engines), got, rules, InflightLedger())
    assert engines.ended == [r.request_id for r in got.preempt]
    # a low request preempts nobody: it is refused as before
    low = Ask(req, 16, NOW, slo, priority="low")
    assert isinstance(decide(low, snap(Engines(queued)), rules), Refused)
    # nothing to preempt on its node: refused
    assert isinstance(decide(ask, snap(Engines([])), rules), Refused)
    # a sheddable class still preempts the classes below it (normal, with normal sheddable too)
    wider = replace(rules, admission=S.model_copy(update={"preempt_priorities": ["low", "normal"]}))
    normal = Ask(req, 16, NOW, slo, priority="normal")
    assert isinstance(decide(normal, snap(Engines(queued)), wider), Routed)


def test_the_simulated_engine_drops_a_request_before_its_first_token_only() -> None:
    core = SimCore(EngineProfile(num_gpu_blocks_override=100, max_num_batched_tokens=256))
    long = SimSeq("long", 600, 4, list(range(1, 40)))  # a prefill of three steps
    queued = SimSeq("queued", 100, 4, list(range(100, 110)))
    core.add(long)
    core.add(queued)
    core.step(0.0)
    free = core.cache.free_blocks
    assert core.abort(long, 0.0)  # prefilling, no token yet: its blocks come back
    assert core.cache.free_blocks > free
    assert not core.abort(long, 0.0)  # (once)
    step = core.step(1.0)  # the queued one goes on
    while queued.first_token_s is None:
        step = core.step(2.0)
    assert not core.abort(queued, queued.first_token_s + 1.0)  # its token is out
    assert step.duration_s >= 0
    core.step(3.0)
    assert all(s is not long for s in core.running.values())
