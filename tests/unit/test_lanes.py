"""Head-of-line isolation (router/decision/lanes.py, router/flow/waiting.py, the ledger's remaining
decode): which requests are long, where they may go, who waits in the router and in what order,
and the simulator's long_tail workload in overload with and without the rules."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from analytics.sim.cluster import simulate
from analytics.sim.simconfig import SimConfig
from analytics.sim.traces import Trace, TraceRequest
from router.decision.holdqueue import UNKNOWN, HoldQueue
from router.decision.inflight import TPOT_PRIOR_S, InflightLedger
from router.decision.lanes import LaneFacts, Lanes, lane_facts, may_wait
from router.decision.policies import make_policy
from router.decision.policies.cost import CompletionCostPolicy
from router.decision.types import RouteRequest
from router.decision.weights import CostWeights, LaneSettings
from router.flow.waiting import RouterQueue, Waiting
from router.settings import RouterSettings
from tests.factories import NOW, node_view

S = LaneSettings()


def test_a_request_is_long_by_its_uncached_prompt_or_its_expected_output() -> None:
    assert not lane_facts(9000, 100, 200, 16, S).long  # a long prompt, cached: short
    f = lane_facts(9000, 9000, 200, 16, S)
    assert f.long and f.long_prompt and f.blocks == -(-9200 // 16)
    g = lane_facts(100, 100, 1024, 16, S)
    assert g.long and not g.long_prompt and g.blocks == -(-1124 // 16)
    assert lane_facts(100, 100, 1023, 16, S) == LaneFacts(1023)


def test_long_requests_keep_within_their_kv_share_of_each_node() -> None:
    lanes = Lanes(S)
    long = lane_facts(2000, 2000, 2000, 16, S)  # 250 blocks
    nodes = [
        node_view("empty", kv_blocks_total=1000),
        node_view("half", kv_blocks_total=1000, long_kv_blocks=300),  # 550 > 500 with it
        node_view("room", kv_blocks_total=1000, long_kv_blocks=200),
    ]
    assert [n.node_id for n in lanes.select(nodes, long)] == ["empty", "room"]
    # a node without long requests takes one however large: it must run somewhere
    huge = lane_facts(2000, 2000, 20_000, 16, S)
    assert [n.node_id for n in lanes.select(nodes, huge)] == ["empty"]
    # short requests are not limited
    assert len(lanes.select(nodes, LaneFacts(10))) == 3


def test_a_lane_takes_long_prompts_and_short_requests_keep_off_it_while_others_have_room() -> None:
    lanes = Lanes(LaneSettings(lane=True, lane_floor=0.25, lane_ceiling=0.5))
    nodes = [node_view(f"n{i}", kv_blocks_total=10_000) for i in range(8)]
    lane = lanes.lane(nodes)
    assert len(lane) == 2  # the floor: no long prompt seen yet
    for _ in range(50):  # long prompts bring most of the prefill work: the lane grows
        lanes.observe(20_000, True, NOW)
        lanes.observe(500, False, NOW)
    grown = lanes.lane(nodes)
    assert len(grown) == 4 and lane <= grown  # to the ceiling, keeping its nodes
    long_prompt = lane_facts(20_000, 20_000, 10, 16, lanes.s)
    assert {n.node_id for n in lanes.select(nodes, long_prompt)} == grown
    short = {n.node_id for n in lanes.select(nodes, LaneFacts(10))}
    assert short == {n.node_id for n in nodes} - grown
    # every node off the lane queued: short requests may use the lane
    busy = [replace(n, prefill_backlog_tokens=0 if n.node_id in grown else 50_000) for n in nodes]
    assert len(lanes.select(busy, LaneFacts(10))) == 8


def test_tight_slo_classes_never_wait_and_are_never_left_without_a_node() -> None:
    from admission.settings import DEFAULT_SLO_CLASSES

    assert may_wait(None) and may_wait(DEFAULT_SLO_CLASSES["batch"])
    assert not may_wait(DEFAULT_SLO_CLASSES["interactive"])
    assert not may_wait(DEFAULT_SLO_CLASSES["standard"])
    lanes = Lanes(S)
    full = [node_view("a", kv_blocks_total=1000, long_kv_blocks=480)]
    long = lane_facts(2000, 2000, 2000, 16, S)
    assert lanes.select(full, long) == []  # it waits for room
    assert [n.node_id for n in lanes.select(full, long, strict=False)] == ["a"]


def test_requests_are_held_while_their_best_node_is_queued() -> None:
    lanes = Lanes(S, prefill_tokens_per_s=1000.0)
    assert not lanes.hold(node_view("a", prefill_backlog_tokens=900))  # 0.9 s ≤ 1 s
    assert lanes.hold(node_view("a", prefill_backlog_tokens=1500))
    assert lanes.hold(node_view("a", waiting=2))  # 2 × the average prompt (1024) = 2 s
    assert lanes.hold(None)  # no node may take it now
    assert not Lanes(LaneSettings(hold=False)).hold(node_view("a", waiting=50))
    # short requests first; a long one yields to short ones up to long_yield_s younger
    assert lanes.key(100.0, True) > lanes.key(105.0, False)
    assert lanes.key(100.0, True) < lanes.key(111.0, False)


def test_the_hold_queue_releases_in_order_and_passes_over_blocked_long_requests() -> None:
    q: HoldQueue[str] = HoldQueue(max_blocked_long=2)
    q.push(3.0, False, "short-late")
    q.push(1.0, False, "short")
    q.push(0.5, True, "long-a")
    q.push(0.7, True, "long-b")
    q.push(0.9, True, "long-c")
    tried: list[str] = []

    def only_short(item: str) -> str | None:
        tried.append(item)
        return None if item.startswith("short") else "node-x"

    # long ones that cannot go are passed over, up to max_blocked_long
    assert q.release(only_short) == 0 and tried == ["long-a", "long-b"] and len(q) == 5
    q2: HoldQueue[str] = HoldQueue()
    for key, long, item in [(0.5, True, "long"), (1.0, False, "short-1"), (2.0, False, "short-2")]:
        q2.push(key, long, item)
    tried.clear()
    assert q2.release(only_short) == 2 and tried == ["long", "short-1", "short-2"] and len(q2) == 1
    # a short request held for an unknown reason ends the round: the ones behind it would too
    q3: HoldQueue[str] = HoldQueue()
    q3.push(1.0, False, "a")
    q3.push(2.0, False, "b")
    assert q3.release(lambda item: UNKNOWN) == 0 and len(q3) == 2


def test_a_queued_node_holds_back_only_the_requests_that_want_it() -> None:
    """Requests with prefix affinity want different nodes: one held by a busy node must not
    keep the requests behind it from idle nodes; the others that want the busy node are passed
    over without being routed again, in their order."""
    busy = {"n1"}
    want = {"a1": "n1", "b1": "n2", "a2": "n1", "c1": "n3", "a3": "n1"}
    q: HoldQueue[str] = HoldQueue()
    for i, item in enumerate(want):
        q.push(float(i), False, item, want[item] if item != "a2" else UNKNOWN)
    tried: list[str] = []

    def attempt(item: str) -> str | None:
        tried.append(item)
        return want[item] if want[item] in busy else None

    assert q.release(attempt) == 2
    # a2 was pushed without its node: tried once, then known; a3 is passed over untried
    assert tried == ["a1", "b1", "a2", "c1"] and len(q) == 3
    busy.clear()
    tried.clear()
    assert q.release(attempt) == 3 and tried == ["a1", "a2", "a3"]  # in order
    # a round ends after max_failed held attempts
    q2: HoldQueue[str] = HoldQueue(max_failed=2)
    for i in range(5):
        q2.push(float(i), False, f"x{i}", f"n{i}")
    tried.clear()
    assert q2.release(lambda item: tried.append(item) or "n" + item[1:]) == 0 and len(tried) == 2


def test_the_router_queue_wakes_waiters_in_order_and_drops_the_ones_that_left() -> None:
    async def run() -> None:
        q: RouterQueue[str] = RouterQueue(poll_s=0.01, max_waiting=10)
        open_ = {"room": 0}
        order: list[str] = []

        def retry(name: str) -> Waiting[str]:
            def go() -> str | None:
                if open_["room"] <= 0:
                    return None
                open_["room"] -= 1
                order.append(name)
                return name

            return Waiting(go)

        waiters = [
            asyncio.create_task(q.wait(2.0, True, retry("long"), 5.0)),
            asyncio.create_task(q.wait(1.0, False, retry("short"), 5.0)),
            asyncio.create_task(q.wait(1.5, False, retry("gone"), 0.05)),
        ]
        await asyncio.sleep(0.1)  # "gone" gives up meanwhile
        assert len(q) == 3
        open_["room"] = 5
        q.wake()
        got = await asyncio.gather(*waiters)
        assert got == ["long", "short", None] and order == ["short", "long"]
        assert len(q) == 0

        def broken() -> str | None:
            raise ValueError("no route")

        # a request whose re-routing fails gets the error; the ones behind it still go
        failing = asyncio.create_task(q.wait(1.0, False, Waiting(broken), 5.0))
        after = asyncio.create_task(q.wait(2.0, False, retry("after"), 5.0))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="no route"):
            await failing
        assert await after == "after"
        await q.stop()

    asyncio.run(run())


def test_the_ledger_counts_remaining_decode_long_kv_and_learns_each_nodes_tpot() -> None:
    led = InflightLedger()
    led.dispatch("a", "n", 0.0, 100, expected_output=1001, long_blocks=70)
    led.dispatch("b", "n", 0.0, 100, expected_output=11)
    assert led.remaining_decode("n", 0.0) == 1012 and led.long_blocks("n") == 70
    led.first_token("a", 1.0)
    led.first_token("b", 1.0)
    # 3 s later at the prior 30 ms per token: 100 tokens each, less their first
    assert led.remaining_decode("n", 1.0 + 100 * TPOT_PRIOR_S) == 1012 - 2 - 200
    led.finish("b", 1.2, 11)  # ended early: 20 ms per token, taught to the node
    assert led.tpot_s("n") == pytest.approx(0.02)
    assert led.remaining_decode("n", 1.0) == 1000
    led.finish("a")
    assert led.remaining_decode("n", 5.0) == 0 and led.long_blocks("n") == 0
    # re-dispatched (a reroute) it counts once, on its new node
    led.dispatch("c", "n", 0.0, 10, expected_output=50, long_blocks=9)
    led.dispatch("c", "m", 0.1, 10, expected_output=50, long_blocks=9)
    assert led.long_blocks("n") == 0 and led.long_blocks("m") == 9
    assert led.remaining_decode("n", 0.2) == 0 and led.remaining_decode("m", 0.2) == 50
    # dispatched again on the same node (counted when the queue released it, then sent)
    led.dispatch("c", "m", 0.2, 10, expected_output=50, long_blocks=9)
    assert led.unreflected("m", 0.0) == 1 and led.long_blocks("m") == 9


def test_the_cost_counts_the_kv_growth_of_decodes_still_ahead_of_a_node() -> None:
    policy = CompletionCostPolicy(CostWeights(), 0.95, 8)
    req = RouteRequest("r", "m", (), 160, 64)
    calm = node_view("calm", used=60)
    growing = node_view("growing", used=60, decode_backlog_tokens=40 * 16)
    assert policy.model.cost(req, growing, 0)["kv_s"] > policy.model.cost(req, calm, 0)["kv_s"]
    assert policy.decide(req, [growing, calm], {}, NOW).chosen == "calm"


def _long_tail(n: int, rate: float, seed: int = 1) -> Trace:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < 0.1
        prompt = rng.randint(6000, 12_000) if long else rng.randint(100, 1500)
        answer = rng.randint(800, 1500) if long else rng.randint(10, 200)
        out.append(TraceRequest(t, prompt, answer, tuple(range(i << 12, (i << 12) + prompt // 16))))
    return Trace("mini_long_tail", 16, tuple(out))


def test_in_overload_short_requests_overtake_long_ones_in_the_simulator() -> None:
    trace = _long_tail(1500, 90.0)
    settings = RouterSettings(policy="kvgate")
    # the router's candidate cap off: in this overload every node's queue passes it, and the
    # router would refuse with 503 (nodes_unhealthy); only the lane rules differ here
    base = SimConfig(nodes=4, max_queue=1_000_000)

    def short_ttft_p99(cfg: SimConfig) -> tuple[float, int]:
        done = simulate(trace, make_policy(settings), cfg)
        short = sorted(
            d.first_token_s - d.request.arrival_s
            for d in done
            if d.request.prompt_tokens < 6000 and d.request.output_tokens < 800
        )
        return short[int(0.99 * len(short))], len(done)

    without, n0 = short_ttft_p99(base)
    with_, n1 = short_ttft_p99(replace(base, lanes=settings.lanes))
    assert n0 == n1 == 1500  # nothing lost: held requests all ran
    assert with_ < 0.7 * without, (with_, without)


def test_the_ledger_learns_each_nodes_prefill_rate_from_streamed_first_tokens() -> None:
    """A first token comes back once the node prefilled what this router queued there before
    the request and the request's own uncached prompt: that work over the time taken."""
    led = InflightLedger()
    assert led.prefill_rate("n") == 0.0  # unknown: the cost model uses its configured rate
    t = 0.0
    for i in range(3):
        led.dispatch(f"a{i}", "n", t, 1000)  # nothing ahead
        led.dispatch(f"b{i}", "n", t, 1000)  # 1,000 tokens ahead of it
        led.first_token(f"a{i}", t + 0.5)  # 2,000 tokens/s
        led.first_token(f"b{i}", t + 1.0)  # (1,000 + 1,000) / 1.0 s
        led.finish(f"a{i}")
        led.finish(f"b{i}")
        t += 10
    assert led.prefill_rate("n") == pytest.approx(2000.0)
    assert led.router_state("n", 0.0, t)[4] == pytest.approx(2000.0)
    # short prompts (the decode step and the network dominate) and non-streamed answers (the
    # "first token" is the end) teach nothing
    led.dispatch("short", "n", t, 100)
    led.first_token("short", t + 1.0)
    led.dispatch("whole", "n", t, 4000)
    led.first_token("whole", t + 60.0, learn=False)
    assert led.prefill_rate("n") == pytest.approx(2000.0)
    led.router_state("other", 0.0, t, "another-model")
    assert led.prefill_rate("other") == 0.0  # nothing learned for its model


def test_the_nodes_of_a_model_share_the_mean_of_their_learned_prefill_rates() -> None:
    """Samples scatter: each node of a fleet of equal engines would otherwise get an arbitrary
    edge. Another model's nodes (other engines) have their own mean."""
    led = InflightLedger()
    for node, model in (("a", "m"), ("b", "m"), ("big", "m70")):
        led.router_state(node, 0.0, 0.0, model)
    t = 0.0
    for node, seconds in (("a", 0.5), ("b", 0.4), ("big", 2.0)):  # 2,000; 2,500; 500 /s
        for i in range(3):
            led.dispatch(f"{node}{i}", node, t, 1000)
            led.first_token(f"{node}{i}", t + seconds)
            led.finish(f"{node}{i}")
    assert led.prefill_rate("a") == pytest.approx(2250) == led.prefill_rate("b")
    assert led.router_state("b", 0.0, 1.0, "m")[4] == pytest.approx(2250)
    assert led.prefill_rate("big") == pytest.approx(500)
    assert led.node_prefill_rate("b") == pytest.approx(2500)


def test_the_rate_the_agents_measured_counts_until_the_router_has_learned_one() -> None:
    """Before any first token came back, a miss is priced at the rate the nodes' agents measured
    on the idle engines (their mean per model), not at the configured constant; learned samples
    take over; a node that moves to another model takes its report along."""
    led = InflightLedger()
    assert led.router_state("a", 0.0, 0.0, "m", 1900.0)[4] == pytest.approx(1900)
    assert led.router_state("b", 0.0, 0.0, "m", 2100.0)[4] == pytest.approx(2000)
    assert led.router_state("c", 0.0, 0.0, "m")[4] == pytest.approx(2000)  # its agent did not
    assert led.router_state("big", 0.0, 0.0, "m70", 500.0)[4] == pytest.approx(500)
    led.router_state("b", 0.0, 0.0, "m", 2300.0)  # re-measured after an engine restart
    assert led.prefill_rate("a") == pytest.approx(2100)
    led.router_state("b", 0.0, 0.0, "m70", 2300.0)  # b serves the big model now
    assert led.prefill_rate("a") == pytest.approx(1900)
    assert led.prefill_rate("big") == pytest.approx(1400)
    for i in range(3):  # a's own first tokens: 1,000 tokens in 0.8 s
        led.dispatch(f"a{i}", "a", 10.0 * i, 1000)
        led.first_token(f"a{i}", 10.0 * i + 0.8)
        led.finish(f"a{i}")
    assert led.router_state("c", 0.0, 40.0, "m")[4] == pytest.approx(1250)
