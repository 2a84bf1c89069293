"""The one composition of the routing rules (router/decision/pipeline.py), table-driven, time
passed in: one case per outcome the live router and the simulator can get, and the promise that
deciding learns nothing."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from admission.settings import DEFAULT_SLO_CLASSES, AdmissionSettings
from admission.slo import Slo
from router.decision.fleet import Fleet
from router.decision.hotprefix import HotPrefixes
from router.decision.inflight import InflightLedger
from router.decision.lanes import Lanes
from router.decision.pipeline import (
    Ask,
    Held,
    Mode,
    Refused,
    Routed,
    Rules,
    Snapshot,
    commit,
    decide,
)
from router.decision.policies import LeastRequestsPolicy, make_policy
from router.decision.policies.cost import CompletionCostPolicy
from router.decision.types import NodeView, RouteRequest
from router.decision.weights import LaneSettings, OutlierSettings, SlowStartSettings
from router.settings import RouterSettings
from tests.factories import NOW, node_view

BATCH: Slo = ("batch", DEFAULT_SLO_CLASSES["batch"])
INSTANT: Slo = ("instant", DEFAULT_SLO_CLASSES["interactive"].model_copy(update={"ttft_s": 1e-6}))


def rules(policy: str = "kvgate", lanes: bool = False, **kw: Any) -> Rules:
    return Rules(
        make_policy(RouterSettings(policy=policy)),
        Fleet(OutlierSettings(enabled=False), SlowStartSettings(window_s=0)),
        AdmissionSettings(),
        Lanes(LaneSettings(enabled=lanes)),
        fallback=LeastRequestsPolicy(),
        **kw,
    )


def request(prompt_tokens: int = 160, blocks: int = 10, session: str | None = None) -> RouteRequest:
    return RouteRequest("r1", "m", list(range(1, blocks + 1)), prompt_tokens, 16, session)


@dataclass
class Case:
    name: str
    nodes: list[NodeView]
    matches: dict[str, int] = field(default_factory=dict)
    req: RouteRequest = field(default_factory=request)
    mode: Mode = "proxy"
    slo: Slo | None = None
    hold_slo: bool = False
    policy: str = "kvgate"
    lanes: bool = False
    load_only: bool = False
    roles: bool = False
    fit_hold_s: float = 0.0
    fit_queue: bool = False
    want: tuple[str, str | None, str] = ("routed", "a", "prefix_hit")  # kind, node, reason


CASES = [
    Case("a prefix hit", [node_view("a"), node_view("b")], {"a": 10}),
    Case(
        "the holder overloaded: a fallback",
        [node_view("a", waiting=100), node_view("b")],
        {"a": 10},
        want=("routed", "b", "overload_fallback"),
    ),
    Case(
        "no node will ever hold the prompt",
        [node_view("a"), node_view("b")],
        req=request(prompt_tokens=200 * 16, blocks=200),
        want=("refused", None, "too_large"),
    ),
    Case(
        "no node has room now",
        [node_view("a", used=95), node_view("b", used=95)],
        req=request(prompt_tokens=50 * 16, blocks=50),
        want=("refused", None, "no_fit_now"),
    ),
    Case(
        "no node has room now: proxied, it waits for room",
        [node_view("a", used=95), node_view("b", used=95)],
        req=request(prompt_tokens=50 * 16, blocks=50),
        fit_hold_s=10.0,
        want=("held", "fit", "fit"),
    ),
    Case(
        "no node has room now: past its hold, the engine's queue on the node nearest to room",
        [node_view("a", used=95), node_view("b", used=92), node_view("c", used=96)],
        req=request(prompt_tokens=50 * 16, blocks=50),
        fit_queue=True,
        want=("routed", "b", "all_overloaded"),
    ),
    Case(
        "no node has room now: nearest counts the prefix a node holds",
        [node_view("a", used=95), node_view("b", used=92)],
        {"a": 10},
        req=request(prompt_tokens=50 * 16, blocks=50),
        fit_queue=True,
        want=("routed", "a", "all_overloaded"),
    ),
    Case(
        "no node has room now: a gateway is refused at once even where the engine would queue",
        [node_view("a", used=95), node_view("b", used=95)],
        req=request(prompt_tokens=50 * 16, blocks=50),
        fit_queue=True,
        mode="gateway",
        want=("refused", None, "no_fit_now"),
    ),
    Case(
        "no node has room now: a gateway is refused at once",
        [node_view("a", used=95), node_view("b", used=95)],
        req=request(prompt_tokens=50 * 16, blocks=50),
        fit_hold_s=10.0,
        mode="gateway",
        want=("refused", None, "no_fit_now"),
    ),
    Case(
        "only where it fits",
        [node_view("a", used=95), node_view("b", used=10, waiting=3)],
        {"a": 2},
        req=request(prompt_tokens=50 * 16, blocks=50),
        policy="least_requests",
        want=("routed", "b", "least_requests"),
    ),
    Case("no candidates", [], want=("refused", None, "no_healthy_node")),
    Case(
        "a degraded feed: least requests, no hit claims",
        [node_view("a", waiting=3), node_view("b")],
        {"a": 10},
        load_only=True,
        want=("routed", "b", "least_requests"),
    ),
    Case(
        "its class's TTFT cannot be met: refused early",
        [node_view("a"), node_view("b")],
        {"a": 10},
        slo=INSTANT,
        want=("refused", None, "deadline"),
    ),
    Case(
        "a loose class waits while its best node is queued",
        [node_view("a", waiting=6), node_view("b", waiting=6)],
        slo=BATCH,
        hold_slo=True,
        want=("held", "slo", "slo"),
    ),
    Case(
        "a gateway is never held",
        [node_view("a", waiting=6), node_view("b", waiting=6)],
        slo=BATCH,
        hold_slo=True,
        mode="gateway",
        want=("routed", None, "least_cost"),
    ),
    Case(
        "the lane rules hold it while the engines are queued",
        [node_view("a", waiting=40), node_view("b", waiting=40)],
        lanes=True,
        want=("held", "lanes", "lanes"),
    ),
    Case(
        "a dry run is never held",
        [node_view("a", waiting=40), node_view("b", waiting=40)],
        lanes=True,
        mode="query",
        want=("routed", None, "least_cost"),
    ),
    Case(
        "a P/D pair when both roles exist",
        [
            node_view("p", role="prefill"),
            node_view("d", role="decode"),
        ],
        roles=True,
        req=request(prompt_tokens=960, blocks=60),
        want=("routed", "d", "disaggregated"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decide(case: Case) -> None:
    r = rules(case.policy, lanes=case.lanes, fit_hold_s=case.fit_hold_s, fit_queue=case.fit_queue)
    ask = Ask(case.req, 16, NOW, case.slo, case.hold_slo, case.mode)
    for n in case.nodes:  # every node big enough for the fit cases
        n.kv_blocks_total = 100
    snap = Snapshot(case.nodes, case.matches, NOW, 16, load_only=case.load_only, roles=case.roles)
    got = decide(ask, snap, r)
    kind, node, reason = case.want
    if kind == "routed":
        assert isinstance(got, Routed), got
        assert node is None or got.decision.chosen == node
        assert got.decision.reason == reason
    elif kind == "refused":
        assert isinstance(got, Refused), got
        assert got.decision.chosen is None and got.decision.reason == reason
    else:
        assert isinstance(got, Held) and got.why == node, got
        assert isinstance(got.now, Routed | Refused)  # what going at once would be


def test_decide_learns_nothing_and_commit_learns_once() -> None:
    """Deciding a thousand times leaves the rules as they were (the policy, the fleet's
    counts, the lane mix); a commit records the request in the in-flight ledger, the policy and
    the lane rules once."""
    r = rules(lanes=True)
    nodes = [node_view("a", kv_blocks_total=1000), node_view("b", kv_blocks_total=1000)]
    ask = Ask(request(prompt_tokens=3200, blocks=200, session="s1"), 16, NOW)
    snap = Snapshot(nodes, {"a": 190}, NOW, 16)
    assert isinstance(r.policy, CompletionCostPolicy) and r.lanes is not None
    before = copy.deepcopy(
        (r.policy.sessions.homes, r.policy.model.avg_uncached, r.lanes.long_share())
    )
    for _ in range(1000):
        got = decide(ask, snap, r)
    assert (r.policy.sessions.homes, r.policy.model.avg_uncached, r.lanes.long_share()) == before
    assert isinstance(got, Routed)
    ledger = InflightLedger()
    commit(ask, snap, got, r, ledger)
    assert len(ledger) == 1
    assert ledger.prefill_backlog("a") == got.uncached_tokens == 3200 - 190 * 16
    assert r.policy.sessions.homes == {hash("s1"): "a"} and r.policy.model.avg_uncached != before[1]


def test_an_index_lag_does_not_discount_the_hits_of_approximate_tokens() -> None:
    """A request of approximate tokens matches only through the router's memory of where it sent
    each prompt: the index (the engines' exact tokens) cannot match it, so how far behind the
    index is says nothing about those hits. With exact tokens a lagging index's hits are
    trusted less (the cost policy's confidence) and the request goes elsewhere."""
    lagging = node_view("b", kv_index_gap=4, kv_index_age_s=10.0, running=2, kv_blocks_total=1000)
    nodes = [node_view("a", kv_blocks_total=1000), lagging]
    req = request(prompt_tokens=3200, blocks=200)
    snap = Snapshot(nodes, {"b": 200}, NOW, 16)
    exact = decide(Ask(req, 16, NOW), snap, rules())
    approximate = decide(Ask(req, 16, NOW, exact=False), snap, rules())
    assert isinstance(exact, Routed) and exact.decision.chosen == "a"
    assert isinstance(approximate, Routed) and approximate.decision.chosen == "b"
    assert approximate.decision.reason == "prefix_hit"


def test_every_routed_prefix_is_counted_and_a_hot_one_is_worth_copying() -> None:
    """The hot-prefix counter sees every committed request (with pre-warm advice off too), and
    decide() hands the policy its longest held prefix's traffic share: on a cluster with no node
    free, the followers of a prefix that carries all the traffic spread to a second node (a copy
    relieves its holder), where those of a prefix seen for the first time stay behind it."""
    hot = HotPrefixes(min_requests=1)
    r = rules(hot=hot, prewarm=False)
    saturated = [
        node_view("a", kv_blocks_total=1000, waiting=4),
        node_view("b", kv_blocks_total=1000, waiting=4, prefill_backlog_tokens=12_000),
    ]
    req = request(prompt_tokens=1600, blocks=100)
    snap = Snapshot(saturated, {"b": 60}, NOW, 16)
    first = decide(Ask(req, 16, NOW), snap, r)
    assert isinstance(first, Routed) and first.decision.reason == "prefix_hit"
    for _ in range(30):
        assert commit(Ask(req, 16, NOW), snap, first, r, InflightLedger()) is None  # no advice
    assert hot.prefix_share(req.block_hashes, {"b": 60}, NOW) == pytest.approx(1.0)
    again = decide(Ask(req, 16, NOW), snap, r)
    assert isinstance(again, Routed) and again.decision.chosen == "a"
    assert again.decision.reason == "spread"
