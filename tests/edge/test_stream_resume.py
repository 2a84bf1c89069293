"""Mid-stream failover: a stream whose engine dies mid-answer is continued on another node and
the client sees one stream — the same id, one role delta, every token once (the same text as an
uninterrupted run with the same seed), one usage block counting the whole answer — while the
reservation stays with the request and the records say what happened."""

from __future__ import annotations

import asyncio
from typing import Any

from streams.codec import decode
from streams.schemas import Outcome
from streams.topics import OUTCOMES
from tests.edgekit import MODEL, Edge, bearer, edge
from tests.ssekit import note_event, stream_record

TOKENS = 120


def _body(i: int, chat: bool) -> dict[str, Any]:
    prompt = f"request {i}: tell me about caches " * 20
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": TOKENS,
        "stream": True,
        "seed": 1000 + i,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _stream(e: Edge, body: dict[str, Any], url: str | None = None) -> dict[str, Any]:
    """One stream read to its end: its node, events, text, role deltas, usage blocks, errors."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    got = stream_record()
    async with e.http.post((url or e.url) + path, json=body, headers=bearer("sk-alpha")) as r:
        assert r.status == 200
        got["node"] = r.headers.get("X-Kvgate-Node")
        async for line in r.content:
            note_event(got, line)
    return got


async def test_streams_broken_mid_answer_continue_on_another_node_without_a_seam() -> None:
    async with edge(engines=2, router={"policy": "least_requests"}) as e:
        bodies = [_body(i, chat=i % 2 == 0) for i in range(8)]
        calls = [asyncio.create_task(_stream(e, b)) for b in bodies]

        async def under_way() -> None:  # streams under way on both engines: n1's break off
            while len(e.sims["n1"]._streaming) < 2:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(under_way(), 10)
        await asyncio.sleep(0.3)
        broken = e.sims["n1"].crash_streams()
        assert broken >= 2
        results = await asyncio.wait_for(asyncio.gather(*calls), 60)

        # the same requests, uninterrupted, straight to an engine
        wants = await asyncio.gather(*(_stream(e, b, url=e.engines["n2"]) for b in bodies))
        for body, got, want in zip(bodies, results, wants, strict=True):
            assert got["errors"] == 0
            assert "".join(got["text"]) == "".join(want["text"])  # no token lost or repeated
            assert len(got["text"]) == TOKENS
            assert len(got["ids"]) == 1 and got["roles"] == (1 if "messages" in body else 0)
            (usage,) = got["usage"]  # one usage block, the whole answer's
            assert usage["completion_tokens"] == TOKENS
            assert usage["prompt_tokens"] == want["usage"][0]["prompt_tokens"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + TOKENS

        outcomes = [decode(Outcome, v) for v in e.published(OUTCOMES.suffix)]
        resumed = [o for o in outcomes if o.resumes]
        assert len(resumed) == broken
        assert all(o.status == "ok" and o.node_id == "n2" for o in resumed)
        assert all(o.output_tokens == TOKENS for o in outcomes)
        reasons = [d.reason for d in e.decisions() if d.decision_seq]
        assert len(reasons) == broken and all(r.startswith("resume/") for r in reasons)
        assert await e.reservations() == 0


async def test_a_stream_that_cannot_be_continued_ends_with_the_error_event() -> None:
    """Two choices are not one text to continue: the client gets the error event, as before,
    and nothing stays held."""
    async with edge(engines=2, router={"policy": "least_requests"}) as e:
        body = {**_body(1, chat=False), "n": 2}
        call = asyncio.create_task(_stream(e, body))
        while not any(e.sims[n]._streaming for n in e.sims):
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        assert sum(s.crash_streams() for s in e.sims.values()) == 1
        got = await asyncio.wait_for(call, 30)
        assert got["errors"] == 1
        (o,) = [decode(Outcome, v) for v in e.published(OUTCOMES.suffix)]
        assert o.status == "error" and o.resumes == 0
        assert await e.reservations() == 0


async def test_a_drain_moves_its_streams_after_the_grace_instead_of_waiting_for_them() -> None:
    """n1 begins to drain (its heartbeat says so) while streams run there: after
    ``router.drain_grace_s`` they go on from n2, whole, long before they would have ended on
    n1; the engine is not blamed for it (no ejection)."""
    router = {"policy": "least_requests", "drain_grace_s": 0.5}
    async with edge(engines=2, router=router) as e:
        bodies = [{**_body(i, chat=i % 2 == 1), "max_tokens": 400} for i in range(6)]
        calls = [asyncio.create_task(_stream(e, b)) for b in bodies]
        while len(e.sims["n1"]._streaming) < 2:
            await asyncio.sleep(0.02)
        on_n1 = len(e.sims["n1"]._streaming)
        e.overrides = {"n1": {"draining": True}}
        t0 = asyncio.get_running_loop().time()
        while e.sims["n1"]._streaming:
            await asyncio.sleep(0.05)
        moved_after = asyncio.get_running_loop().time() - t0
        assert moved_after < 2.5  # (400 tokens take ~3.5 s of an engine)
        results = await asyncio.wait_for(asyncio.gather(*calls), 60)
        wants = await asyncio.gather(*(_stream(e, b, url=e.engines["n2"]) for b in bodies))
        for got, want in zip(results, wants, strict=True):
            assert got["errors"] == 0 and len(got["ids"]) == 1
            assert "".join(got["text"]) == "".join(want["text"])
        outcomes = [decode(Outcome, v) for v in e.published(OUTCOMES.suffix)]
        assert sum(o.resumes for o in outcomes) == on_n1
        assert not e.router.director.fleet.detector.nodes["n1"].ejected_until
        assert await e.reservations() == 0
