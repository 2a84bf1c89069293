"""The engine's prefill rate, measured by the agent before any request needs it.

A router that does not know how fast an engine prefills prices a miss with a configured constant
(``cost.prefill_tokens_per_s``) until its own requests have taught it the engine's rate: engines
12× slower than that constant make the first seconds of routing spread prompts that should have
waited for their cached copy. The agent measures the rate instead, when it starts and whenever
the engine restarts, on an idle engine (no request running or waiting, so nothing else shares the
steps): two one-token completions of a short and a long prompt, each beginning with a word of its
own so that no prefix cache can answer it; the rate is the difference of the engine's own prompt
token counts (``usage``, less its ``cached_tokens``) over the difference of the two times, which
takes out what both pay alike (the HTTP round trip, scheduling, the one decode step). Three such
pairs, the median kept. The heartbeat carries it (``prefill_tokens_per_s``); routers use it until
their own requests' first tokens have taught them the rate (router/decision/inflight.py).

What the probe costs: a few thousand prompt tokens of an idle engine, once per engine start.
"""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from collections.abc import Mapping

import aiohttp

__all__ = ["PrefillProbe", "probe_words", "rate_from_pairs"]

log = logging.getLogger(__name__)

# plain words, each usually one token; the engine counts what it really got (usage)
_WORDS = (
    "river stone light garden window paper market silver autumn letter harbor engine forest "
    "signal meadow bridge copper lantern valley ticket morning island thunder orchard canvas"
).split()

PAIRS = 3
MAX_RATE = 1e7  # prompt tokens/s: no engine is faster; a pair past it timed noise, not work
RETRY_S = 15.0  # an engine busy (or not answering) when a probe was due: try again this late


def probe_words(n: int, nonce: str) -> str:
    """A prompt of about ``n`` words that no cache holds: it starts with ``nonce``."""
    return " ".join([nonce, *(_WORDS[i % len(_WORDS)] for i in range(max(0, n - 1)))])


def rate_from_pairs(pairs: list[tuple[int, float, int, float]]) -> float | None:
    """Prompt tokens per second from (short tokens, short s, long tokens, long s) pairs: the
    median of each pair's difference quotient; None when no pair is usable (the long prompt
    not longer, or not slower, than the short; or a quotient past :data:`MAX_RATE`, which only
    timing noise gives)."""
    rates = [
        rate
        for short_tokens, short_s, long_tokens, long_s in pairs
        if long_tokens > short_tokens
        and long_s > short_s
        and (rate := (long_tokens - short_tokens) / (long_s - short_s)) <= MAX_RATE
    ]
    return statistics.median(rates) if rates else None


class PrefillProbe:
    """Measures one engine's prefill rate when it is due (at start, after a restart) and the
    engine is idle. ``rate``: the last measurement (None until one succeeded)."""

    def __init__(
        self,
        engine_url: str,
        headers: Mapping[str, str],
        long_tokens: int = 2048,
        timeout_s: float = 30.0,
    ) -> None:
        self.url = engine_url.rstrip("/") + "/v1/completions"
        self.headers = dict(headers)
        self.long_tokens = long_tokens
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.rate: float | None = None
        self.due = True
        self.failures = 0
        self._next_try = 0.0

    def restarted(self) -> None:
        """The engine restarted: it may be another engine now (a new GPU, a new model)."""
        self.due = True
        self._next_try = 0.0

    def ready(self, now: float, idle: bool) -> bool:
        """Whether to probe now: due, idle, and not within :data:`RETRY_S` of a failed try."""
        return self.due and idle and now >= self._next_try

    def failed(self, now: float) -> None:
        """A probe gave no figure (an error, a timeout): try again :data:`RETRY_S` later."""
        self.failures += 1
        self._next_try = now + RETRY_S

    async def measure(
        self, http: aiohttp.ClientSession, model: str, max_model_len: int | None, now: float
    ) -> float | None:
        """Probe now; on success ``rate`` is the new figure and the probe is no longer due."""
        longest = self.long_tokens
        if max_model_len:
            longest = max(64, min(longest, max_model_len // 2))
        pairs: list[tuple[int, float, int, float]] = []
        try:
            for _ in range(PAIRS):
                short = await self._one(http, model, 16)
                long = await self._one(http, model, longest)
                pairs.append((*short, *long))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            log.info("prefill probe of %s failed: %s", self.url, exc)
            pairs = []
        rate = rate_from_pairs(pairs)
        if rate is None:
            self.failed(now)
            return None
        self.rate, self.due = rate, False
        log.info("engine at %s prefills %.0f prompt tokens/s", self.url, rate)
        return rate

    async def _one(self, http: aiohttp.ClientSession, model: str, words: int) -> tuple[int, float]:
        """One uncached one-token completion: (prompt tokens computed, seconds)."""
        body = {
            "model": model,
            "prompt": probe_words(words, f"kvgate-probe-{uuid.uuid4().hex}"),
            "max_tokens": 1,
            "temperature": 0.0,
            "stream": False,
        }
        started = time.perf_counter()
        async with http.post(self.url, json=body, headers=self.headers, timeout=self.timeout) as r:
            r.raise_for_status()
            answer = await r.json(content_type=None)
        took = time.perf_counter() - started
        usage = answer["usage"]
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") or 0
        computed = int(usage["prompt_tokens"]) - int(cached)
        if computed <= 0:
            raise ValueError("the engine computed none of the probe's prompt")
        return computed, took
