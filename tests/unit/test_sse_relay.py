"""The streaming relay passes an engine's SSE stream on chunk by chunk, however the engine's writes
are split: the client gets every byte in order (less the usage chunk it did not ask for), and
the first token, output tokens and usage are seen as on a line-by-line read."""

from __future__ import annotations

import asyncio
import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.flow.served import Served
from router.http.proxy import ClientStalled, StallBudget, _write
from router.http.sse import SseLines


def _event(obj: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stream(tokens: list[str], chat: bool, crlf: bool) -> bytes:
    """A vLLM-style stream: a role chunk (chat), one chunk per token, the finish chunk, the
    usage chunk (choices empty) and [DONE]."""
    out = []
    if chat:
        out.append(_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
    for tok in tokens:
        choice = {"index": 0, "delta": {"content": tok}} if chat else {"index": 0, "text": tok}
        out.append(_event({"id": "c", "choices": [choice], "usage": None}))
    out.append(_event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
    usage = {"prompt_tokens": 7, "completion_tokens": len(tokens), "total_tokens": 7}
    out.append(_event({"choices": [], "usage": usage}))
    out.append(b": keep-alive\n\ndata: [DONE]\n\n")
    body = b"".join(out)
    return body.replace(b"\n", b"\r\n") if crlf else body


def reference(body: bytes, include_usage: bool) -> tuple[bytes, int, dict[str, object] | None]:
    """Line by line: the client's bytes, output tokens and usage."""
    kept, tokens, usage, skip = [], 0, None, False
    for line in body.splitlines(keepends=True):
        if skip and line in (b"\n", b"\r\n"):
            skip = False
            continue
        skip = False
        if line.startswith(b"data: {"):
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
                if not chunk["choices"] and not include_usage:
                    skip = True
                    continue
            ch = chunk["choices"]
            if ch and (ch[0].get("text") or (ch[0].get("delta") or {}).get("content")):
                tokens += 1
        kept.append(line)
    return b"".join(kept), tokens, usage


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.sampled_from(["a", "é", " b", "\n", "{", "data: x"]), max_size=8),
    chat=st.booleans(),
    crlf=st.booleans(),
    include_usage=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
    unterminated=st.booleans(),
)
def test_any_split_of_the_stream_relays_as_read_line_by_line(
    tokens: list[str],
    chat: bool,
    crlf: bool,
    include_usage: bool,
    cuts: list[int],
    unterminated: bool,
) -> None:
    body = stream(tokens, chat, crlf)
    if unterminated:
        body = body.rstrip(b"\r\n")  # the engine's last line without its newline
    want, want_tokens, want_usage = reference(body, include_usage)
    firsts: list[int] = []
    relay = Served()
    lines = SseLines(relay, include_usage, lambda: firsts.append(1), 0.0)
    edges = sorted({0, len(body), *(c for c in cuts if c < len(body))})
    got = b"".join(lines.feed(body[a:b]) for a, b in itertools.pairwise(edges))
    got += lines.feed(b"", final=True)
    assert got == want
    assert relay.output_tokens == want_tokens and relay.usage == want_usage
    assert len(firsts) == (1 if want_tokens else 0)
    assert (relay.ttft_s is not None) == bool(want_tokens)


def test_nothing_is_held_back_but_an_unfinished_line() -> None:
    relay = Served()
    lines = SseLines(relay, False, None, 0.0)
    first = _event({"choices": [{"index": 0, "text": "hi"}]})
    assert lines.feed(first + first[:9]) == first  # the first token goes out at once
    assert relay.ttft_s is not None and lines.rest == first[:9]
    assert lines.feed(first[9:]) == first


class _Reply:
    """A client connection whose buffer is full (``paused``) until ``release``: a client that
    takes nothing."""

    def __init__(self, paused: bool = True) -> None:
        self.paused = paused
        self.release = asyncio.Event()
        self.written: list[bytes] = []

    def write_nowait(self, data: bytes) -> bool:
        self.written.append(data)
        return not self.paused

    async def drain(self) -> None:
        await self.release.wait()


_STALL = StallBudget(0.05)


async def test_a_write_waits_only_while_the_clients_buffer_is_full() -> None:
    """A write the client's buffer takes returns at once, without a timer; one that fills it
    waits for the buffer to drain, and a client that takes nothing for the write timeout is
    cut off."""
    free = _Reply(paused=False)
    await _write(free, b"y", _STALL)  # type: ignore[arg-type]
    assert free.written == [b"y"]
    full = _Reply()
    with pytest.raises(ClientStalled):
        await _write(full, b"x", _STALL)  # type: ignore[arg-type]
    taking = asyncio.create_task(_write(full, b"z", StallBudget(5.0)))  # type: ignore[arg-type]
    await asyncio.sleep(0.1)
    assert not taking.done()
    full.release.set()  # the client reads again
    await taking
    assert full.written == [b"x", b"z"]


async def test_a_stalled_write_is_cut_within_its_budget_only_while_the_pool_is_contended() -> None:
    """Past the stall budget a waiting write asks whether others wait for KV: cut off then
    (within the budget and one check), never before the budget, and only at the timeout
    while nobody waits."""
    contended = False
    stall = StallBudget(timeout_s=2.0, budget_s=0.2, contended=lambda: contended)
    loop = asyncio.get_running_loop()
    resp = _Reply()
    t0 = loop.time()
    with pytest.raises(ClientStalled, match="took nothing for 2 s"):
        await _write(resp, b"x", stall)  # type: ignore[arg-type]
    assert loop.time() - t0 >= 2.0
    contended = True
    t0 = loop.time()
    with pytest.raises(ClientStalled, match="while others wait for KV"):
        await _write(resp, b"x", stall)  # type: ignore[arg-type]
    assert 0.2 <= loop.time() - t0 < 1.0
    contended = False
    late = asyncio.create_task(_write(resp, b"z", stall))  # type: ignore[arg-type]
    await asyncio.sleep(0.5)
    contended = True  # others start waiting while it stalls: cut at the next check
    with pytest.raises(ClientStalled, match="while others wait"):
        await late
    resp.release.set()
    await _write(resp, b"y", stall)  # type: ignore[arg-type]
    assert resp.written[-1] == b"y"  # (a cut-off write's bytes were in the buffer already)
