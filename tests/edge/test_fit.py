"""Fragmentation and fit (router/decision/fit.py): a request goes only where its KV fits now; 503
with Retry-After when some node could hold it but none can now, 413 when none ever could."""

from __future__ import annotations

import asyncio

from router.decision.fit import fit, nearest
from router.decision.types import NodeView
from tests.edgekit import MODEL, bearer, edge
from tests.factories import node_view


def _view(nid: str, total: int, used: int, **kw: object) -> NodeView:
    return node_view(nid, used=used, kv_blocks_total=total, **kw)


def test_fit_reads_the_heartbeat_figure_or_derives_it() -> None:
    a = _view("a", 200, 150)  # derived: 200 - 150 - 2 (1 % watermark) = 48 blocks
    b = _view("b", 200, 0, kv_blocks_admissible=20)  # the agent knows better (evictable)
    got = fit([a, b], 48 * 16, {})
    assert [n.node_id for n in got.nodes] == ["a"] and got.largest_now_blocks == 48
    assert got.largest_ever_blocks == 198 and got.ever
    hit = fit([a, b], 60 * 16, {"b": 45})  # b holds 45 of the 60 prompt blocks: 15 new fit
    assert [n.node_id for n in hit.nodes] == ["b"]
    never = fit([a, b], 199 * 16, {})
    assert not never.ever and not never.nodes
    short = fit([_view("c", 200, 0, max_model_len=1024)], 1024, {})
    assert not short.ever  # at its context limit: no room for one output token


def test_a_full_holder_keeps_the_requests_that_need_few_new_blocks_there() -> None:
    """A node whose running requests fill its KV (no room now) stays a candidate for a request
    that holds a prefix there and needs at most QUEUE_SHARE of its blocks more: the engine
    queues it until they free (within a decode), where any other node would compute the whole
    prompt again. A request needing more, or holding nothing there, still goes only where it
    fits now."""
    full = _view("full", 1000, 1000, kv_blocks_admissible=0)
    free = _view("free", 1000, 0)
    prompt = 200 * 16
    assert [n.node_id for n in fit([full, free], prompt, {"full": 190}).nodes] == ["full", "free"]
    assert [n.node_id for n in fit([full, free], prompt, {"full": 90}).nodes] == ["free"]
    assert [n.node_id for n in fit([full, free], prompt, {}).nodes] == ["free"]
    alone = fit([full], prompt, {"full": 195})
    assert [n.node_id for n in alone.nodes] == ["full"] and alone.largest_now_blocks == 0


async def test_routing_admission_and_metrics_follow_the_fit() -> None:
    prompt = list(range(1, 1501))  # 1,500 tokens: 94 blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    # refused at once
    async with edge(blocks=200, router={"fit_hold_s": 0, "fit_overflow": "refuse"}) as e:
        full = {"kv_blocks_used": 150}  # 48 blocks left on each: the cluster has 96
        e.overrides = {"n1": full, "n2": full}
        await asyncio.sleep(0.5)
        status, out, headers = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
        assert status == 503, out
        assert out["error"]["kvgate_reason"] == "no_fit_now" and out["error"]["retriable"]
        assert int(headers["Retry-After"]) >= 1
        e.overrides = {"n1": full}  # n2 drained its requests
        await asyncio.sleep(0.5)
        for _ in range(3):  # only n2 has room: every one goes there
            status, out, _ = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
            assert status == 200, out
        assert [d.chosen_node for d in e.decisions()] == [None, "n2", "n2", "n2"]
        assert e.decisions()[0].reason == "no_fit_now"
        e.overrides = {"n1": {"max_model_len": 1024}, "n2": {"max_model_len": 1024}}
        await asyncio.sleep(0.5)
        status, out, _ = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
        assert status == 413 and out["error"]["kvgate_reason"] == "too_large"
        assert not out["error"]["retriable"]
        assert await e.reservations() == 0  # the refused requests hold nothing
        status, text, _ = await e.call("GET", "/metrics")
        assert status == 200
        assert f'kvgate_router_fit_tokens{{model="{MODEL}",pool="default",when="ever"}} 3168.0' in (
            text
        )


def test_nearest_is_the_fewest_blocks_short_among_nodes_that_could_ever_hold_it() -> None:
    prompt = 100 * 16
    small = _view("small", 90, 0)  # could never hold 100 blocks, however empty
    limited = _view("limited", 400, 390, max_model_len=1000)  # its context limit is shorter
    a = _view("a", 200, 150)  # 48 admissible: 52 short
    b = _view("b", 200, 0, kv_blocks_admissible=30)  # 70 short…
    assert [n.node_id for n in nearest([small, limited, a, b], prompt, {})] == ["a"]
    # … unless it holds the prompt's first 30 blocks: 40 short
    assert [n.node_id for n in nearest([a, b], prompt, {"b": 30})] == ["b"]
    twin = _view("twin", 200, 150)
    assert [n.node_id for n in nearest([a, twin], prompt, {})] == ["a", "twin"]  # ties kept
    assert nearest([small], prompt, {}) == [small]  # none could: the nodes as given


def test_a_prompt_within_every_floor_fits_everywhere() -> None:
    import random

    from router.decision.fit import fit_floor_tokens

    rng = random.Random(7)
    for _ in range(200):
        nodes = [
            _view(
                f"n{i}",
                rng.randint(8, 400),
                0,
                kv_blocks_used=rng.randint(0, 400),
                max_model_len=rng.choice([None, rng.randint(64, 8000)]),
            )
            for i in range(rng.randint(1, 6))
        ]
        floor = min(fit_floor_tokens(n) for n in nodes)
        for prompt in (max(1, floor - 5), floor, floor + 1, floor + 300):
            got = fit(nodes, prompt, {})
            if prompt <= floor:  # the router skips the pass: it must have found every node
                assert got.ever and [n.node_id for n in got.nodes] == [n.node_id for n in nodes]


async def test_a_request_that_fits_nowhere_now_waits_for_room_then_goes() -> None:
    """Proxied, a request whose KV fits on no node now waits in the router (``fit_hold_s``) as
    an engine would queue it, and goes once a node has room; past the hold it is the 503 where
    ``fit_overflow`` is ``refuse``."""
    prompt = list(range(1, 1501))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    async with edge(blocks=200, router={"fit_hold_s": 1.5, "fit_overflow": "refuse"}) as e:
        full = {"kv_blocks_used": 150}
        e.overrides = {"n1": full, "n2": full}
        await asyncio.sleep(0.5)
        t0 = asyncio.get_running_loop().time()
        status, out, headers = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
        waited = asyncio.get_running_loop().time() - t0
        assert status == 503 and out["error"]["kvgate_reason"] == "no_fit_now", out
        assert waited >= 1.4  # it waited for room first

        async def free_n2() -> None:
            await asyncio.sleep(0.6)
            e.overrides = {"n1": full}  # n2 drained its requests

        freeing = asyncio.create_task(free_n2())
        status, out, headers = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
        await freeing
        assert status == 200, out
        assert headers["X-Kvgate-Node"] == "n2"
        assert await e.reservations() == 0


async def test_past_its_hold_a_request_goes_to_the_engine_queue_nearest_to_room() -> None:
    """At the defaults (``fit_overflow: queue``), a request still without room after its hold
    goes to the node nearest to having it, whose engine queues it until its running requests
    free the blocks (as vLLM does), instead of a 503 that requests arriving later would have
    taken the room from."""
    prompt = list(range(1, 1501))  # 94 blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    async with edge(blocks=200, router={"fit_hold_s": 0.5}) as e:
        e.overrides = {"n1": {"kv_blocks_used": 160}, "n2": {"kv_blocks_used": 140}}
        await asyncio.sleep(0.5)
        status, out, headers = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
        assert status == 200, out
        assert headers["X-Kvgate-Node"] == "n2"  # 58 blocks short there, 78 on n1
        assert [d.chosen_node for d in e.decisions()] == ["n2"]
        assert await e.reservations() == 0
