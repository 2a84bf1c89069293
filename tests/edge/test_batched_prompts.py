"""Batched completions (a list of prompts, as vLLM takes them): routed by the first prompt to
one engine, admitted and recorded for all of them, one choice per prompt."""

from __future__ import annotations

import orjson
import pytest

from router.parse import parse_request
from tests.edgekit import MODEL, bearer, edge


def test_a_batch_counts_every_prompt() -> None:
    prompts = ["first prompt " * 20, "second " * 10, "third " * 5]
    body = orjson.dumps({"model": MODEL, "prompt": prompts, "max_tokens": 4, "n": 2})
    p = parse_request(body, False, 16)
    one = parse_request(orjson.dumps({"model": MODEL, "prompt": prompts[0]}), False, 16)
    assert p.tokens == one.tokens  # routed (hashed) by the first prompt
    assert p.prompt_tokens_total > len(p.tokens) and p.sequences == 6
    ids = orjson.dumps({"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2})
    q = parse_request(ids, False, 16)
    assert q.tokens == [1, 2, 3] and q.prompt_tokens_total == 5 and q.exact_tokens
    for bad in ([], [[]], ["x"] * 257):
        with pytest.raises(ValueError):
            parse_request(orjson.dumps({"model": MODEL, "prompt": bad}), False, 16)


async def test_a_batch_is_served_with_one_choice_per_prompt() -> None:
    prompts = [f"batched prompt number {i} " * 12 for i in range(3)]
    async with edge() as e:
        body = {"model": MODEL, "prompt": prompts, "max_tokens": 3}
        status, out, _ = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
        assert status == 200, out
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert out["usage"]["completion_tokens"] == 9
        (d,) = e.decisions()
        assert d.prompt_tokens >= out["usage"]["prompt_tokens"] * 0.9  # all prompts admitted
        assert await e.reservations() == 0
