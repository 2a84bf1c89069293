"""Synthetic request generators (live demo and benchmarks)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["ChatRequestSpec", "shared_prompt_chat", "words"]

_WORDS = (
    "account billing invoice refund shipping order delivery password login router cache token "
    "latency queue budget replica cluster prompt session upgrade plan warranty device reset "
    "network storage backup region quota limit error timeout retry support ticket agent"
).split()


@dataclass(frozen=True, slots=True)
class ChatRequestSpec:
    arrival_s: float
    body: dict[str, Any]


def words(rng: random.Random, count: int) -> str:
    """``count`` words of the support vocabulary, drawn by ``rng``."""
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def shared_prompt_chat(
    model: str,
    rps: float,
    duration_s: float,
    *,
    bots: int = 4,
    system_words: int = 600,
    user_words: tuple[int, int] = (10, 120),
    max_tokens: tuple[int, int] = (16, 96),
    seed: int = 7,
) -> Iterator[ChatRequestSpec]:
    """Support-bot traffic: a few long system prompts shared by many short user turns.

    Poisson arrivals at ``rps``; each request picks a bot (its system prompt is the shared
    prefix), a user message and an output limit, and asks for a streamed answer.
    """
    rng = random.Random(seed)
    systems = [
        f"You are support bot {b}. " + words(random.Random(seed * 1000 + b), system_words)
        for b in range(bots)
    ]
    t = 0.0
    n = 0
    while True:
        t += rng.expovariate(rps)
        if t >= duration_s:
            return
        bot = rng.randrange(bots)
        n += 1
        yield ChatRequestSpec(
            t,
            {
                "model": model,
                "messages": [
                    {"role": "system", "content": systems[bot]},
                    {"role": "user", "content": words(rng, rng.randint(*user_words))},
                ],
                "max_tokens": rng.randint(*max_tokens),
                "stream": True,
                "user": f"user-{rng.randrange(50)}",
            },
        )
