"""Continuing a broken stream (router/http/resume.py): what can be continued, the request that
asks for the rest, and the continuation's events made part of the first stream."""

from __future__ import annotations

from typing import Any

import orjson

from agents.sequence import VOCAB, first_salt
from router.http.resume import Splice, Trail, continuation
from router.parse import parse_request
from streams.blocks import approx_tokenize
from streams.openai import ChatRequest
from streams.tokenization import APPROXIMATE


def _parse(body: dict[str, Any], chat: bool) -> Any:
    return parse_request(orjson.dumps(body), chat, 256)


def _chunk(text: str, chat: bool, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = (
        {"index": 0, "delta": {"content": text}, "finish_reason": None}
        if chat
        else {"index": 0, "text": text, "finish_reason": None}
    )
    return {"id": "first", "created": 7, "model": "m", "choices": [choice], **extra}


def test_a_chat_continues_as_its_final_assistant_message_with_the_limits_reduced() -> None:
    p = _parse(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 10,
            "min_tokens": 4,
            "stream": True,
            "seed": 3,
            "temperature": 0.5,
        },
        chat=True,
    )
    trail = Trail(p)
    assert trail.resumable
    for piece in ("the ", "kv  ", "and "):
        trail.observe(_chunk(piece, chat=True))
    body = orjson.loads(continuation(p, trail) or b"")
    assert body["messages"][-1] == {"role": "assistant", "content": "the kv  and "}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["min_tokens"]) == (7, 1)
    assert (body["seed"], body["temperature"]) == (3, 0.5)


def test_a_completion_continues_with_the_text_after_its_prompt() -> None:
    p = _parse({"model": "m", "prompt": ["once "], "max_tokens": 3, "stream": True}, chat=False)
    trail = Trail(p)
    trail.observe(_chunk("upon ", chat=False))
    body = orjson.loads(continuation(p, trail) or b"")
    assert (body["prompt"], body["max_tokens"]) == ("once upon ", 2)
    for piece in ("a ", "time"):
        trail.observe(_chunk(piece, chat=False))
    assert continuation(p, trail) is None  # every token asked for was sent


def test_what_is_not_one_text_is_not_continued() -> None:
    base = {"model": "m", "prompt": "x", "max_tokens": 9, "stream": True}
    assert Trail(_parse({**base, "n": 2}, chat=False)).why_not == "several choices"
    assert Trail(_parse({**base, "logprobs": 2}, chat=False)).why_not == "log probabilities"
    assert Trail(_parse({**base, "prompt": [1, 2, 3]}, chat=False)).why_not
    assert Trail(_parse({**base, "stream": False}, chat=False)).why_not == "not streamed"
    trail = Trail(_parse({**base, "messages": [{"role": "user", "content": "x"}]}, chat=True))
    trail.observe({"id": "a", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    assert not trail.resumable
    done = Trail(_parse(base, chat=False))
    done.observe({"id": "a", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    assert done.finished and not done.resumable


def test_the_continuation_speaks_as_the_first_stream_with_one_usage_for_the_whole() -> None:
    p = _parse(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        chat=True,
    )
    trail = Trail(p)
    trail.observe(_chunk("the ", chat=True))
    trail.observe(_chunk("kv  ", chat=True))
    splice = Splice(p, trail)
    role_only = {
        "id": "second",
        "created": 9,
        "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
    }
    assert splice.rewrite(role_only) is None
    first = splice.rewrite(
        {
            "id": "second",
            "created": 9,
            "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "and "}}],
        }
    )
    assert first is not None
    assert (first["id"], first["created"], first["choices"][0]["delta"]) == (
        "first",
        7,
        {"content": "and "},
    )
    usage = {
        "prompt_tokens": 12,  # the prompt's 10 and the 2 tokens sent before
        "completion_tokens": 5,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 12},
    }
    end = splice.rewrite({"id": "second", "choices": [], "usage": usage})
    assert end is not None
    assert end["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 7,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 10},
    }


def test_a_continued_conversation_tokenizes_as_the_prompt_then_the_text_so_far() -> None:
    """The approximate tokenization (and the simulated engine's template): a final assistant
    message continued starts on a token boundary, so the continuation's prompt is the first
    prompt's tokens followed by the output's."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hey"}]
    asked = ChatRequest.model_validate({"model": "m", "messages": messages})
    first = APPROXIMATE.encode_chat(asked)
    text = "the kv  and "
    cont = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [*messages, {"role": "assistant", "content": text}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
    )
    assert APPROXIMATE.encode_chat(cont) == first + approx_tokenize(text)


def test_the_simulated_model_goes_on_with_a_text_it_generated() -> None:
    """Its next word follows from the last output word in the prompt; else the seed decides."""
    words = list(VOCAB)
    salt = 4
    out = [words[(salt + 7 * i) % len(words)] for i in range(5)]
    assert first_salt([1, 2, *out[:3]], None, 99) == (salt + 7 * 3) % len(words)
    assert first_salt([1, 2], 45, 99) == 45 % len(words)
    assert first_salt([1, 2], None, 99) == 99
