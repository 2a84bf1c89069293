"""Completions go to the engine as the router's token ids once the engine's ``/tokenize`` has
agreed with the router on the model (the engine then does not tokenize the prompt again), and as
text before that, where the engine has no ``/tokenize`` or disagreed, and for chat."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from streams.tokenization import TokenizerSpec, load_tokenization
from tests.edgekit import MODEL, _serve, bearer, edge
from tests.unit.test_chat_templates import CHATML_TOOLS, TOKENIZER

SPEC = TokenizerSpec(tokenizer=TOKENIZER, chat_template=CHATML_TOOLS)
TEXT = "Route each request where its prefix is cached. " * 12


async def _engine(agree: bool | None, bodies: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    """An engine that records what it is asked; its /tokenize agrees with the router's
    tokenizer (``agree``), disagrees, or is missing (None)."""
    tk = load_tokenization(SPEC)

    async def complete(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        usage = {"prompt_tokens": 5, "completion_tokens": 1}
        choice = {"index": 0, "text": "ok", "finish_reason": "length"}
        return web.json_response({"choices": [choice], "usage": usage})

    async def tokenize(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        ids = tk.encode_prompt(body["prompt"])
        return web.json_response({"tokens": ids if agree else ids[1:], "count": len(ids)})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    if agree is not None:
        app.router.add_post("/tokenize", tokenize)
    return await _serve(app)


async def _sent(agree: bool | None, requests: int = 3) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []
    runner, url = await _engine(agree, bodies)
    router = {"tokenizers": {MODEL: SPEC}, "tokenize_check_every": 1, "tokenize_check_min": 1}
    try:
        async with edge(engines=1, router=router) as e:
            e.engines["n1"] = url
            await asyncio.sleep(0.3)
            for _ in range(requests):
                body = {"model": MODEL, "prompt": TEXT, "max_tokens": 1}
                status, out, _ = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
                assert status == 200, out
                await asyncio.sleep(0.2)  # the check runs beside the request
            chat = {"model": MODEL, "messages": [{"role": "user", "content": TEXT}]}
            status, out, _ = await e.call("POST", "/v1/chat/completions", chat, bearer("sk-alpha"))
            assert status == 200, out
    finally:
        await runner.cleanup()
    return bodies


async def test_ids_once_the_engine_agrees_text_before_and_for_chat() -> None:
    *completions, chat = await _sent(agree=True)
    ids = load_tokenization(SPEC).encode_prompt(TEXT)
    assert completions[0]["prompt"] == TEXT  # the first check had not answered yet
    assert [c["prompt"] for c in completions[1:]] == [ids, ids]
    assert chat["messages"][0]["content"] == TEXT and "prompt" not in chat


async def test_text_where_the_engine_disagrees_or_cannot_say() -> None:
    for agree in (False, None):
        *completions, _ = await _sent(agree)
        assert [c["prompt"] for c in completions] == [TEXT] * 3, agree
