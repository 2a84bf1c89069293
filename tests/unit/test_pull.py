"""A prefix's KV pulled from its holder instead of computed again (router/decision/pull.py, the
cost policy's third choice, and the simulator's two legs)."""

from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest

from admission.settings import AdmissionSettings
from agents.profile import EngineProfile
from analytics.sim.cluster import SimCluster
from analytics.sim.simconfig import Done, SimConfig
from analytics.sim.traces import Trace, TraceRequest
from router.decision.fleet import Fleet
from router.decision.pipeline import Ask, Routed, Rules, Snapshot, decide
from router.decision.policies.cost import CompletionCostPolicy
from router.decision.pull import pull_body, pull_s, pull_source
from router.decision.types import NodeView, PolicyBase, RouteDecision, RouteRequest
from router.decision.weights import CostWeights, OutlierSettings, SlowStartSettings
from tests.factories import node_view
from tests.unit.test_policy import NOW

W = CostWeights()
LONG = RouteRequest("r1", "m", list(range(250)), prompt_tokens=4_000, max_tokens=16)


def policy(skips_queue: bool = True, **over: object) -> CompletionCostPolicy:
    """The cost policy; ``skips_queue``: pulls ask holders for priority (router.pull_priority)."""
    return CompletionCostPolicy(
        W.model_copy(update=over), 0.9, max_queue=8, pull_skips_queue=skips_queue
    )


def big(nid: str, **kw: object) -> NodeView:
    return node_view(nid, kv_blocks_total=2_000, kv_pull=True, **kw)


def busy_holder(**kw: object) -> NodeView:
    """Has ~0.65 s of prompts waiting (8 of this router's average uncached prompt, none being
    computed); the tests give it the prompt's first 240 blocks."""
    return big("b", waiting=8, prefill_backlog_tokens=8 * 2_048, **kw)


def test_pull_source_is_the_deepest_holder_that_gives_kv() -> None:
    nodes = [big("a"), big("b"), node_view("c", kv_pull=False)]
    assert pull_source(nodes, {"a": 10, "b": 40, "c": 90}) == pull_source(nodes, {"a": 10, "b": 40})
    src = pull_source(nodes, {"a": 10, "b": 40, "c": 90})
    assert src is not None and (src.node_id, src.blocks) == ("b", 40)
    assert pull_source(nodes, {"c": 90}) is None
    assert pull_source([replace(big("a"), healthy=False)], {"a": 5}) is None
    # 4,000 tokens of Llama-3.1-8B's KV (128 KiB each) over 100 Gb/s: ~42 ms
    assert pull_s(4_000, 131_072, 100.0, 0.0) == pytest.approx(0.0419, abs=1e-4)


def test_a_busy_holder_s_prefix_is_pulled_where_there_is_room() -> None:
    """Without a pull the idle node computes the prompt again (``spread``); with one it loads
    the holder's 240 blocks and computes the rest: its prefill is the part no node holds, and
    the move is priced as ``pull_s``."""
    nodes = [big("a"), busy_holder()]
    d = policy(kv_pull=False).decide(LONG, nodes, {"b": 240}, NOW)
    assert (d.chosen, d.reason, d.pull) == ("a", "spread", None)
    d = policy().decide(LONG, nodes, {"b": 240}, NOW)
    assert (d.chosen, d.reason, d.pull, d.pull_blocks) == ("a", "kv_pull", "b", 240)
    parts = d.chosen_candidate.components if d.chosen_candidate else {}
    rate = W.prefill_tokens_per_s
    assert parts["prefill_s"] == pytest.approx(W.prefill_weight * (4_000 - 240 * 16) / rate)
    assert parts["pull_s"] == pytest.approx(pull_s(240 * 16, 131_072, 100.0, W.pull_overhead_s))


def test_without_priority_the_pull_waits_in_the_holder_s_queue() -> None:
    """A leg that does not go ahead of the holder's queue answers after it: the ~0.65 s queued
    there make computing the prefix on the idle node cheaper."""
    d = policy(skips_queue=False).decide(LONG, [big("a"), busy_holder()], {"b": 240}, NOW)
    assert (d.chosen, d.reason, d.pull) == ("a", "spread", None)


def test_no_pull_where_an_engine_cannot_or_the_holder_is_free() -> None:
    # the idle node's engine cannot take KV, or the holder's cannot give it: computed again
    for nodes in (
        [replace(big("a"), kv_pull=False), busy_holder()],
        [big("a"), replace(busy_holder(), kv_pull=False)],
    ):
        d = policy().decide(LONG, nodes, {"b": 240}, NOW)
        assert (d.chosen, d.reason, d.pull) == ("a", "spread", None)
    # a free holder: the request goes there (a hit, nothing moves)
    d = policy().decide(LONG, [big("a"), big("b")], {"b": 240}, NOW)
    assert (d.chosen, d.reason, d.pull) == ("b", "prefix_hit", None)


def test_a_holder_computing_a_long_prompt_answers_late() -> None:
    """A holder answers the pull after the prompts it is computing (an engine schedules its
    running prefills first): 100k tokens in progress there (nothing waiting) make the pull
    slower than computing the prefix again."""
    computing = big("b", running=1, prefill_backlog_tokens=100_000)
    d = policy().decide(LONG, [big("a"), computing], {"b": 240}, NOW)
    assert (d.chosen, d.reason, d.pull) == ("a", "spread", None)


def test_a_slow_link_prices_the_pull_out() -> None:
    slow = [big("a", kv_link_gbps=0.5), busy_holder()]  # 4 GB at 62.5 MB/s
    d = policy().decide(LONG, slow, {"b": 240}, NOW)
    assert (d.chosen, d.reason, d.pull) == ("a", "spread", None)


class Scripted(PolicyBase):
    """Sends each request where the test says (request id -> decision)."""

    name = "scripted"

    def __init__(self, plan: dict[str, RouteDecision]) -> None:
        self.plan = plan

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        return self.plan[request.request_id]


PREFIX = tuple(range(1, 101))  # 100 blocks, 1,600 tokens


def _pulled(blocker_blocks: int) -> tuple[SimCluster, dict[str, Done]]:
    """r0 computes PREFIX on node-00; r1 (PREFIX and 8 tokens more) is sent to node-01 with a
    pull of PREFIX from node-00; r2, sent to node-01 just before, holds ``blocker_blocks`` of
    its 200 blocks while r2's KV arrives."""
    reqs = (
        TraceRequest(0.0, 1_608, 4, PREFIX),
        TraceRequest(4.9, blocker_blocks * 16, 100, tuple(range(5_000, 5_000 + blocker_blocks))),
        TraceRequest(5.0, 1_608, 4, PREFIX),
    )
    plan = {
        "r0": RouteDecision("node-00", "least_cost", ()),
        "r1": RouteDecision("node-01", "least_cost", ()),
        "r2": RouteDecision("node-01", "kv_pull", (), pull="node-00", pull_blocks=100),
    }
    profile = EngineProfile(num_gpu_blocks_override=200, block_size=16)
    cfg = SimConfig(nodes=2, profile=profile, kv_pull=True)
    sim = SimCluster(Trace("pull", 16, reqs), Scripted(plan), cfg)
    return sim, {d.request.request_id or "": d for d in sim.run()} | {
        f"r{i}": d for i, d in enumerate(sorted(sim.done, key=lambda d: d.request.arrival_s))
    }


def test_a_pulled_prefix_is_served_from_cache_and_announced_by_its_new_holder() -> None:
    sim, done = _pulled(blocker_blocks=8)
    assert done["r2"].node == "node-01" and done["r2"].reason == "kv_pull"
    assert done["r2"].cached_tokens == 1_600  # the pulled blocks, counted as cached tokens
    assert sim.stats["kv_pulled_blocks"] == 100
    # its KV events reached the index: node-01 now holds the prefix for the router too
    assert sim.index.match(PREFIX).get("node-01") == 100
    # the transfer is on the way to the first token: 1,600 tokens of 128 KiB over 100 Gb/s
    assert done["r2"].first_token_s - 5.0 >= 1_600 * 131_072 * 8 / 100e9


def test_a_transfer_without_room_falls_back_to_computing() -> None:
    """node-01 has too few free blocks when the KV arrives (r1 holds 180 of its 200): nothing is
    received, r2 computes its whole prompt there once r1 ends, and is answered."""
    sim, done = _pulled(blocker_blocks=180)
    assert done["r2"].node == "node-01"
    assert done["r2"].cached_tokens == 0
    assert sim.stats["kv_pulled_blocks"] == 0


def test_the_pipeline_sends_a_pull_only_from_the_proxy() -> None:
    """The proxy runs the pull's two legs (its uncached tokens: the part no node holds); a dry
    run shows it; a gateway, which forwards the request itself, gets the same node without it."""
    r = Rules(
        policy(),
        Fleet(OutlierSettings(enabled=False), SlowStartSettings(window_s=0)),
        AdmissionSettings(),
    )
    snap = Snapshot([big("a"), busy_holder()], {"b": 240}, NOW, 16)
    for mode in ("proxy", "query"):
        got = decide(Ask(LONG, 16, NOW, mode=mode), snap, r)
        assert isinstance(got, Routed) and got.decision.pull == "b"
        assert got.uncached_tokens == 4_000 - 240 * 16
    got = decide(Ask(LONG, 16, NOW, mode="gateway"), snap, r)
    assert isinstance(got, Routed) and got.decision.chosen == "a"
    assert (got.decision.pull, got.decision.reason, got.uncached_tokens) == (None, "spread", 4_000)


def test_a_holder_with_no_room_for_the_request_still_gives_its_prefix() -> None:
    """A long context whose holder has no room left for the rest of it (the fit filter passes
    it over) is pulled from that holder to the node with room rather than computed there from
    the start: a node too full to run a request can still hand over what it holds."""
    r = Rules(
        policy(),
        Fleet(OutlierSettings(enabled=False), SlowStartSettings(window_s=0)),
        AdmissionSettings(),
    )
    ctx = RouteRequest("r1", "m", list(range(500)), prompt_tokens=8_000, max_tokens=16)
    full = big("b", used=1_900)  # 100 free blocks: not the 260 the rest of the prompt needs
    snap = Snapshot([big("a"), full], {"b": 240}, NOW, 16)
    got = decide(Ask(ctx, 16, NOW, mode="proxy"), snap, r)
    assert isinstance(got, Routed)
    assert (got.decision.chosen, got.decision.reason) == ("a", "kv_pull")
    assert (got.decision.pull, got.decision.pull_blocks) == ("b", 240)
    assert got.uncached_tokens == 8_000 - 240 * 16
    # an engine that cannot give: computed from the start where there is room
    snap = Snapshot([big("a"), replace(full, kv_pull=False)], {"b": 240}, NOW, 16)
    got = decide(Ask(ctx, 16, NOW, mode="proxy"), snap, r)
    assert isinstance(got, Routed) and got.decision.chosen == "a"
    assert (got.decision.pull, got.uncached_tokens) == (None, 8_000)


def test_the_holder_s_request_is_the_prefix_s_token_ids_kept_for_a_remote_engine() -> None:
    body = {"model": "m", "prompt": "text", "cache_salt": "tenant-a", "stream": True, "n": 3}
    leg = pull_body(body, "m", [5, 6, 7], priority=-1)
    assert leg["prompt"] == [5, 6, 7] and leg["max_tokens"] == 1 and leg["stream"] is False
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert (leg["cache_salt"], leg["priority"]) == ("tenant-a", -1)
    assert "n" not in leg  # nothing else of the client's request
    assert "priority" not in pull_body(body, "m", [5])
