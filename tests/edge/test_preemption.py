"""Fair under saturation, live: a higher class that would miss its deadline in the admission
queue takes the room of sheddable streams that have not produced their first token — they get
one clean 503 ``preempted`` with Retry-After (never half a stream), their engine frees their KV,
the records say so and no reservation stays behind."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from admission.settings import Tenant
from streams.codec import decode
from streams.schemas import Outcome
from streams.topics import OUTCOMES
from tests.edgekit import MODEL, TENANTS, Edge, bearer, edge

SHEDDABLE = {**bearer("sk-beta"), "x-gateway-criticality": "Sheddable"}  # beta, at low priority
# one engine of 300 KV blocks whose prefill is slow (1,000 tokens/s): the low requests' long
# prompts (~70 blocks each) stay before their first token for seconds
SLOW = {"engines": 1, "blocks": 300, "profile": {"prefill_tokens_per_s": 1000.0}}


def _low(i: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"batch {i} " + "word " * 790, "max_tokens": 4}


def _normal(i: int) -> dict[str, Any]:  # ~39 blocks
    return {"model": MODEL, "prompt": f"question {i} " + "ask " * 540, "max_tokens": 8}


async def _call(e: Edge, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """A stream read to its end: its status, headers, and the body's events (or error)."""
    async with e.http.post(
        e.url + "/v1/completions", json={**body, "stream": True}, headers=headers
    ) as r:
        raw = await r.read()
        return {"status": r.status, "headers": r.headers, "raw": raw}


async def _held(e: Edge, n: int) -> None:
    """``n`` requests routed (their decisions recorded: they are on their way to the engine)."""

    async def held() -> None:
        while len(e.decisions()) < n:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(held(), 10)


async def test_a_queued_request_that_would_miss_its_deadline_preempts_sheddable_streams() -> None:
    async with edge(**SLOW) as e:  # type: ignore[arg-type]
        lows = []
        for i in range(3):  # 3 × ~70 blocks: 70 % of the budget, under yellow
            lows.append(asyncio.create_task(_call(e, _low(i), SHEDDABLE)))
            await _held(e, i + 1)
        first = asyncio.create_task(_call(e, _normal(0), bearer("sk-alpha")))
        await _held(e, 4)  # the normal one fits under red: ~82 %
        # past red with it (~95 %): it must queue, with no drain seen its wait is unknown (it
        # would miss its 10 s deadline): the newest low stream makes its room
        second = asyncio.create_task(_call(e, _normal(1), bearer("sk-alpha")))
        results = await asyncio.wait_for(asyncio.gather(*lows, first, second), 60)

        preempted = results[2]
        assert preempted["status"] == 503
        err = orjson.loads(preempted["raw"])["error"]
        assert err["type"] == "preempted" and err["kvgate_reason"] == "preempted"
        assert int(preempted["headers"]["Retry-After"]) >= 1
        assert preempted["headers"]["X-Kvgate-Node"] == "n1"
        for r in (results[0], results[1], results[3], results[4]):
            assert r["status"] == 200 and r["raw"].rstrip().endswith(b"data: [DONE]")
            assert b'"error"' not in r["raw"]

        outcomes = {
            o.request_id: o for o in map(lambda v: decode(Outcome, v), e.published(OUTCOMES.suffix))
        }
        (gone,) = [o for o in outcomes.values() if o.status == "preempted"]
        assert gone.http_status == 503 and gone.node_id == "n1"
        assert gone.request_id == preempted["headers"]["X-Request-Id"]
        assert sum(o.status == "ok" for o in outcomes.values()) == 4
        metrics = e.router.metrics.preemptions.labels("low")._value.get()
        assert metrics == 1
        # the engine dropped the preempted request: nothing of it runs there any more
        assert not any(s.request_id == gone.request_id for s in e.sims["n1"]._streaming)
        assert await e.reservations() == 0


async def test_no_preemption_when_it_is_off_or_for_work_of_the_same_class() -> None:
    """With preemption off the second normal request waits out its deadline (429, the low
    streams are served); and a low request never preempts another low one."""
    async with edge(
        **SLOW,
        admission={
            "preemption": False,
            "queue_timeout_s": {"high": 30.0, "normal": 1.0, "low": 0.0},
        },
    ) as e:  # type: ignore[arg-type]
        lows = []
        for i in range(3):
            lows.append(asyncio.create_task(_call(e, _low(i), SHEDDABLE)))
            await _held(e, i + 1)
        first = asyncio.create_task(_call(e, _normal(0), bearer("sk-alpha")))
        await _held(e, 4)
        second = await _call(e, _normal(1), bearer("sk-alpha"))
        assert second["status"] == 429
        assert orjson.loads(second["raw"])["error"]["kvgate_reason"] == "queue_timeout"
        another_low = await _call(e, _low(9), SHEDDABLE)  # above yellow: refused, nobody ended
        assert another_low["status"] == 429
        results = await asyncio.wait_for(asyncio.gather(*lows, first), 60)
        assert all(r["status"] == 200 for r in results)
        assert e.router.metrics.preemptions.labels("low")._value.get() == 0
        assert await e.reservations() == 0


async def test_a_request_late_behind_sheddable_prefill_on_its_node_preempts_it() -> None:
    """The router counts the engine's prefill at 500 tokens/s: the low streams queue ~4 s
    of prefill on the one node, an interactive request (2 s TTFT) would be refused early
    (429 deadline) — instead the newest low streams that make it late are preempted and it is
    served."""
    tenants = {**TENANTS, "sk-vip": Tenant(name="vip", priority="high", slo_class="interactive")}
    cost = {"cost": {"prefill_tokens_per_s": 500.0}}
    async with edge(**SLOW, router=cost, admission={"tenants": tenants}) as e:  # type: ignore[arg-type]
        lows = []
        for i in range(3):
            lows.append(asyncio.create_task(_call(e, _low(i), SHEDDABLE)))
            await _held(e, i + 1)
        vip = await _call(
            e, {"model": MODEL, "prompt": "quick question", "max_tokens": 4}, bearer("sk-vip")
        )
        assert vip["status"] == 200, vip["raw"]
        results = await asyncio.wait_for(asyncio.gather(*lows), 60)
        statuses = [r["status"] for r in results]
        assert statuses[0] == 200 and 503 in statuses  # the newest went first
        for r in results:
            if r["status"] == 503:
                assert orjson.loads(r["raw"])["error"]["kvgate_reason"] == "preempted"
        n = statuses.count(503)
        assert e.router.metrics.preemptions.labels("low")._value.get() == n
        assert await e.reservations() == 0
