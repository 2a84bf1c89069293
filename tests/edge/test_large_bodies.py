"""A large body is worked on off the event loop: parsing and tokenizing a body past 256 KiB and
hashing a prompt past 65,536 tokens run in the router's offload threads, so the loop keeps serving
other requests and ``/health`` meanwhile (measured in the chaos benchmark); small requests stay
on the loop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import orjson
import pytest

import router.flow.director as director
import router.flow.intake as intake
from tests.edgekit import MODEL, bearer, edge


def _recording(fn: Callable[..., Any], threads: list[int]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return fn(*args, **kwargs)

    return wrapper


async def test_large_bodies_are_parsed_and_hashed_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed: list[int] = []
    hashed: list[int] = []
    monkeypatch.setattr(intake, "parse_request", _recording(intake.parse_request, parsed))
    monkeypatch.setattr(director, "chain_hashes", _recording(director.chain_hashes, hashed))
    loop_thread = threading.get_ident()
    async with edge() as e:
        big = {"model": MODEL, "prompt": "many words in a long document " * 40_000}
        status, out, _ = await e.call("POST", "/v1/completions", big, bearer("sk-alpha"))
        assert status == 413, out  # 300,000 tokens fit on no node: refused after the work
        assert parsed and hashed
        assert loop_thread not in parsed and loop_thread not in hashed
        parsed.clear(), hashed.clear()
        small = {"model": MODEL, "prompt": "hello " * 40, "max_tokens": 2}
        status, out, _ = await e.call("POST", "/v1/completions", small, bearer("sk-alpha"))
        assert status == 200, out
        assert parsed == [loop_thread] and hashed == [loop_thread]
        assert len(orjson.dumps(big)) > 256 << 10
