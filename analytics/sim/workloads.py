"""Synthetic workloads for the simulator, as :class:`~analytics.sim.traces.Trace` objects.

Each generator is a pure function of its seed. Prompts are described by who owns each stretch of
tokens (a system prompt, a session, one request): a block's hash is the hash of the owner of its
last token and its position, which is what a prefix-chained hash gives when every owner's content
is fixed (two requests share block ``i`` exactly when they share the tokens up to its end).

* ``shared_prompt`` — support bots: a few long system prompts, short unique questions.
* ``multi_turn`` — chat sessions whose context grows turn by turn (the answer becomes part of the
  next prompt, so the answer's blocks are listed for reuse).
* ``conversation`` — long assistant conversations (a pasted document or code base, then many
  turns): prompts grow to tens of thousands of tokens, users think for half a minute between
  turns; the workload where keeping a session's KV pays most and losing it costs most.
* ``zipf_hot`` — many prefixes with skewed popularity; one prefix carries ≥ 40 % of the traffic.
* ``long_tail`` — no sharing, heavy-tailed lengths (a control case).
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Sequence

from analytics.sim.traces import Trace, TraceRequest
from streams.blocks import HASH_MASK

__all__ = ["WORKLOADS", "make_workload"]

BLOCK = 16  # vLLM's default block size on CUDA


def _owner_key(owner: str) -> int:
    return zlib.crc32(owner.encode()) << 20


def _hashes(segments: Sequence[tuple[str, int]], start_block: int, end_block: int) -> list[int]:
    """Hashes of blocks ``[start_block, end_block)`` of a prompt made of (owner, tokens)."""
    out = []
    bounds = []
    pos = 0
    for owner, tokens in segments:
        pos += tokens
        bounds.append((pos, _owner_key(owner)))
    j = 0
    for i in range(start_block, end_block):
        last = (i + 1) * BLOCK - 1
        while j < len(bounds) - 1 and bounds[j][0] <= last:
            j += 1
        key = bounds[j][1]
        out.append(((key + i + 1) * 0x9E3779B97F4A7C15) & HASH_MASK)
    return out


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _request(
    t: float,
    segments: list[tuple[str, int]],
    output: int,
    *,
    session: str | None = None,
    reuse_answer: bool = False,
) -> TraceRequest:
    prompt = sum(n for _, n in segments)
    full = prompt // BLOCK
    answer: list[int] = []
    if reuse_answer:
        owner = segments[-1][0]
        answer = _hashes([*segments, (owner, output)], full, (prompt + output) // BLOCK)
    return TraceRequest(
        t,
        prompt,
        output,
        tuple(_hashes(segments, 0, full)),
        session,
        tuple(answer),
    )


def _shared_prefix(
    name: str,
    requests: int,
    rate: float,
    rng: random.Random,
    prefixes: list[tuple[str, int]],
    weights: list[float],
    question: tuple[float, float, int, int],
    answer: tuple[float, float, int, int],
) -> Trace:
    """Poisson arrivals; each request is a prefix drawn by ``weights`` plus a question of its
    own (lognormal: median, sigma, min, max) and an answer of lognormal length."""
    t = 0.0
    out = []
    for i in range(requests):
        t += rng.expovariate(rate)
        owner, length = rng.choices(prefixes, weights)[0]
        q = _lognormal(rng, *question)
        a = _lognormal(rng, *answer)
        out.append(_request(t, [(owner, length), (f"q{i}", q)], a))
    return Trace(name, BLOCK, tuple(out))


def shared_prompt(requests: int, rate: float, seed: int) -> Trace:
    """A few support bots, each with a long system prompt (instructions, policies, few-shot
    examples: 1.5–3k tokens); users ask short questions and get medium answers."""
    rng = random.Random(seed)
    bots = [(f"bot{i}", rng.randint(1500, 3000)) for i in range(6)]
    weights = [1.0 / (i + 1) for i in range(len(bots))]
    return _shared_prefix(
        "shared_prompt", requests, rate, rng, bots, weights, (80, 0.8, 8, 1500), (180, 0.6, 8, 1024)
    )


def _sessions(
    name: str,
    requests: int,
    rate: float,
    rng: random.Random,
    mean_turns: float,
    turns: Callable[[random.Random], int],
    opening: Callable[[random.Random, str], list[tuple[str, int]]],
    question: Callable[[random.Random, int], int | None],
    answer: Callable[[random.Random], int],
    think: Callable[[random.Random], float],
    max_context: int,
    sid_prefix: str,
) -> Trace:
    """Sessions (ids ``<sid_prefix><n>``) arriving at ``rate / mean_turns``: each draws its
    number of turns, opens with ``opening`` (its first segments), then per turn adds the user's
    ``question`` (None: none, e.g. the opening is the first message), asks for an ``answer``
    that joins the conversation (its blocks listed for reuse), and waits ``think`` s; it ends
    early past ``max_context`` tokens. Every prompt is the whole conversation so far."""
    out: list[TraceRequest] = []
    t = 0.0
    s = 0
    while len(out) < requests:
        t += rng.expovariate(rate / mean_turns)
        sid = f"{sid_prefix}{s}"
        s += 1
        n = turns(rng)
        segments = opening(rng, sid)
        at = t
        for turn in range(n):
            q = question(rng, turn)
            if q is not None:
                segments.append((sid, q))
            a = answer(rng)
            out.append(_request(at, list(segments), a, session=sid, reuse_answer=True))
            segments.append((sid, a))
            at += think(rng)
            if sum(n for _, n in segments) > max_context:
                break
    out.sort(key=lambda r: r.arrival_s)
    return Trace(name, BLOCK, tuple(out[:requests]))


def multi_turn(requests: int, rate: float, seed: int) -> Trace:
    """Chat sessions: a short shared system prompt, then turns whose prompt is the whole
    conversation so far; users think ~20 s between an answer and the next message."""
    return _sessions(
        "multi_turn",
        requests,
        rate,
        random.Random(seed),
        mean_turns=5.0,
        turns=lambda rng: min(16, 1 + int(rng.expovariate(1 / 4.0))),
        opening=lambda _rng, _sid: [("chat-system", 350)],
        question=lambda rng, _turn: _lognormal(rng, 120, 0.9, 4, 2000),
        answer=lambda rng: _lognormal(rng, 220, 0.6, 8, 1200),
        think=lambda rng: 2.0 + rng.expovariate(1 / 20.0),
        max_context=24_000,
        sid_prefix="s",
    )


def conversation(requests: int, rate: float, seed: int) -> Trace:
    """Assistant conversations over a document or code base: one of a few apps' system prompts
    (1.5–4k tokens), a first message carrying a pasted context (lognormal around 6k tokens, up
    to 40k), then 3–16 turns (about 7) of short questions and medium answers, each prompt the
    whole conversation so far, capped at 64k tokens; 5 s + ~30 s (exponential) of thinking
    between an answer and the next question."""
    rng = random.Random(seed)
    apps = [(f"app{i}", rng.randint(1500, 4000)) for i in range(4)]
    weights = [1.0 / (i + 1) for i in range(len(apps))]

    def opening(rng: random.Random, sid: str) -> list[tuple[str, int]]:
        app = rng.choices(apps, weights)[0]
        return [app, (sid, _lognormal(rng, 6000, 0.8, 500, 40_000))]  # the pasted context

    return _sessions(
        "conversation",
        requests,
        rate,
        rng,
        mean_turns=7.0,
        turns=lambda rng: min(16, 3 + int(rng.expovariate(1 / 4.0))),
        opening=opening,
        question=lambda rng, turn: _lognormal(rng, 150, 0.9, 4, 4000) if turn else None,
        answer=lambda rng: _lognormal(rng, 400, 0.7, 16, 2048),
        think=lambda rng: 5.0 + rng.expovariate(1 / 30.0),
        max_context=64_000,
        sid_prefix="c",
    )


def zipf_hot(requests: int, rate: float, seed: int) -> Trace:
    """200 document/agent prefixes (1–4k tokens): the hottest carries 45 % of the requests, the
    rest follow Zipf(1.1)."""
    rng = random.Random(seed)
    prefixes = [(f"doc{i}", rng.randint(1000, 4000)) for i in range(200)]
    tail = [1.0 / (i + 1) ** 1.1 for i in range(len(prefixes) - 1)]
    scale = 0.55 / sum(tail)
    weights = [0.45] + [w * scale for w in tail]
    return _shared_prefix(
        "zipf_hot", requests, rate, rng, prefixes, weights, (100, 0.8, 8, 2000), (150, 0.7, 8, 1024)
    )


def _unshared(
    name: str,
    requests: int,
    rate: float,
    seed: int,
    prompt: tuple[float, float, int, int],
    answer: tuple[float, float, int, int],
    tag: str,
) -> Trace:
    """Poisson arrivals of prompts of their own (no sharing), prompt and answer lengths
    lognormal (median, sigma, min, max)."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(requests):
        t += rng.expovariate(rate)
        p = _lognormal(rng, *prompt)
        a = _lognormal(rng, *answer)
        out.append(_request(t, [(f"{tag}{i}", p)], a))
    return Trace(name, BLOCK, tuple(out))


def long_tail(requests: int, rate: float, seed: int) -> Trace:
    """No sharing; prompts lognormal around 800 tokens up to 32k, answers around 150 up to 2k."""
    return _unshared(
        "long_tail", requests, rate, seed, (800, 1.1, 16, 32_000), (150, 0.9, 4, 2048), "r"
    )


def long_prompts(requests: int, rate: float, seed: int) -> Trace:
    """Batch document work: no sharing, prompts lognormal around 16k tokens (1k–32k), short
    answers around 100 — prefill-heavy, and heavy on KV."""
    return _unshared(
        "long_prompts", requests, rate, seed, (16_000, 0.4, 1000, 32_000), (100, 0.6, 8, 1024), "d"
    )


WORKLOADS: dict[str, Callable[[int, float, int], Trace]] = {
    "shared_prompt": shared_prompt,
    "multi_turn": multi_turn,
    "conversation": conversation,
    "zipf_hot": zipf_hot,
    "long_tail": long_tail,
}


def make_workload(name: str, requests: int = 3000, rate: float = 10.0, seed: int = 0) -> Trace:
    gen = WORKLOADS.get(name)
    if gen is None:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    return gen(requests, rate, seed)
