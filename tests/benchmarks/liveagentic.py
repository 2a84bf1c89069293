"""The live comparison's agentic workload (``python -m tests.benchmarks.livepeer --workloads
agentic``): AIPerf's agentic-coding sessions, scaled down, sent through a router in closed loop.

The sessions are the trace ``kvgate bench agentic`` simulates (``traces/aiperf_agentic_code_100s_
seed42.jsonl``): each session's first turn carries its context (a prefix shared by every session,
one shared by its group, its own), each later turn the new tokens a tool returned, with the
delay the agent waited before sending it. Here a turn is a chat request holding the whole
conversation so far: the first turn's text, then every answer the engine streamed back and
every later turn's new text, in order — what an agent client sends. Token counts are divided
by :attr:`AgenticLive.token_scale` (contexts of 62k–200k tokens become a few thousand, for
simulated engines on two cores), outputs by ``output_scale`` and delays by ``delay_scale``;
block ``h`` of the trace is the same words wherever it appears, so shared prefixes are shared.

Load as AIPerf's ``--concurrency`` gives it: ``sessions_at_once`` sessions run at once, each
slot starting the next session of a seeded order when its session ends, until ``duration_s``;
the turns in flight then finish. Every request names its session in ``x-session-id`` (as agent
clients do; a router that reads no session header routes on the prompt alone).

Measured: output tokens per second per engine over the run (what the same engines got through),
tokens per second per user (the median turn's output over its decode time, from the first
token to the last), TTFT p50 / p99 and the end-to-end p99 at the client, the engines' prefix
cache hit rate (their counters), turns completed and failed.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from analytics.sim.metrics import pct
from analytics.workloads import words
from streams.tokenization import approx_tokenize

__all__ = ["AgenticLive", "LiveSession", "drive_sessions", "live_sessions"]

TRACE = Path("traces/aiperf_agentic_code_100s_seed42.jsonl")
BLOCK_TOKENS = 512  # the trace's hash_ids are of 512-token blocks


@dataclass(frozen=True)
class AgenticLive:
    sessions_at_once: int = 16
    token_scale: float = 16.0
    output_scale: float = 4.0
    delay_scale: float = 10.0
    max_turn_tokens: int = 512  # an answer's cap after scaling


@dataclass(frozen=True)
class LiveTurn:
    text: str  # the turn's new content (the first turn: the whole first prompt)
    max_tokens: int
    delay_s: float  # after the previous turn's answer (0 for the first)


@dataclass(frozen=True)
class LiveSession:
    session_id: str
    turns: tuple[LiveTurn, ...]


def _tokens_per_word() -> float:
    """The simulated engine's (approximate) tokens per word of :func:`words`' vocabulary."""
    sample = words(random.Random(0), 2000)
    return len(approx_tokenize(sample)) / 2000


def live_sessions(w: AgenticLive, path: Path = TRACE) -> list[LiveSession]:
    """The trace's sessions as chat turns at ``w``'s scale (see the module)."""
    per_word = _tokens_per_word()
    block_words = max(1, round(BLOCK_TOKENS / w.token_scale / per_word))
    cache: dict[int, str] = {}

    def block(h: int) -> str:
        text = cache.get(h)
        if text is None:
            text = cache[h] = words(random.Random(h), block_words)
        return text

    rows: dict[str, list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.setdefault(str(row["session_id"]), []).append(row)
    out = []
    for sid, turns in rows.items():
        got = []
        for i, row in enumerate(turns):
            want = max(1, round(int(row["input_length"]) / w.token_scale / per_word))
            text = " ".join(block(int(h)) for h in row["hash_ids"]).split(" ")[:want]
            answer = max(1, round(int(row["output_length"]) / w.output_scale))
            delay = 0.0 if i == 0 else float(row.get("delay", 0.0)) / 1000.0 / w.delay_scale
            got.append(LiveTurn(" ".join(text), min(answer, w.max_turn_tokens), delay))
        out.append(LiveSession(sid, tuple(got)))
    return out


async def _turn(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], session: str
) -> dict[str, Any]:
    """One streamed turn: TTFT, end to end, the output tokens and the answer's text."""
    started = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    tokens = chunks = 0
    headers = {"x-session-id": session}
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status != 200:
                await r.read()
                return {"ok": False, "status": r.status}
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if ttft is None:
                            ttft = time.perf_counter() - started
                        parts.append(text)
                        chunks += 1
                usage = chunk.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or 0)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"ok": False, "status": type(exc).__name__}
    end = time.perf_counter() - started
    if ttft is None:
        return {"ok": False, "status": "no token"}
    return {
        "ok": True,
        "ttft_s": ttft,
        "e2e_s": end,
        "decode_s": end - ttft,
        "output_tokens": tokens or chunks,
        "answer": "".join(parts),
    }


async def _session(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    s: LiveSession,
    tag: str,
    deadline: float,
    results: list[dict[str, Any]],
) -> None:
    """``s``'s turns in closed loop until ``deadline`` (a turn in flight then finishes)."""
    messages: list[dict[str, str]] = []
    session = f"{tag}-{s.session_id}"
    for t in s.turns:
        if t.delay_s:
            await asyncio.sleep(t.delay_s)
        if time.perf_counter() >= deadline:
            return
        messages.append({"role": "user", "content": t.text})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": t.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        got = await _turn(http, url, body, session)
        answer = got.pop("answer", "")
        results.append(got)
        if not got["ok"]:
            return  # an agent whose turn failed stops its session
        messages.append({"role": "assistant", "content": answer})


def _order(sessions: list[LiveSession], seed: int) -> Iterator[LiveSession]:
    order = list(sessions)
    random.Random(seed).shuffle(order)
    return iter(order)


async def drive_sessions(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    w: AgenticLive,
    duration_s: float,
    seed: int,
    tag: str,
) -> tuple[list[dict[str, Any]], float]:
    """The sessions at ``w``'s concurrency for ``duration_s`` through ``url``: every turn's
    result and the run's span (seconds until the last turn ended). ``tag`` makes the session ids
    of this run its own (a router must not find a previous run's sessions)."""
    queue = _order(live_sessions(w), seed)
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    deadline = start + duration_s

    async def slot() -> None:
        for s in queue:
            if time.perf_counter() >= deadline:
                return
            await _session(http, url, model, s, tag, deadline, results)

    await asyncio.gather(*(slot() for _ in range(w.sessions_at_once)))
    return results, time.perf_counter() - start


def agentic_figures(
    results: list[dict[str, Any]], span_s: float, engines: int
) -> dict[str, float | int | None]:
    """Per run: tokens per second per engine and per user, TTFT, end to end, turns."""
    ok = [r for r in results if r["ok"]]
    speeds = [r["output_tokens"] / r["decode_s"] for r in ok if r["output_tokens"] > 1]
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
    return {
        "turns": len(ok),
        "tok_s_per_gpu": sum(r["output_tokens"] for r in ok) / span_s / engines,
        "tok_s_per_user": statistics.median(speeds) if speeds else None,
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "e2e_p99_s": pct(e2e, 0.99),
    }
