"""The router's tokenization, checked against the engine's (pure).

One request in ``every`` of a model with a configured tokenizer is also sent to its engine's
``POST /tokenize`` (vLLM and SGLang have one); a different token list is a mismatch. Once at least
``min_checks`` were made and more than ``max_mismatch_share`` of them disagreed, the model's
tokenization is marked approximate: its hashes cannot be the engine's, so the router stops
claiming exact hits for it and its decisions say ``approximate_tokens``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from router.parse import ParsedRequest

__all__ = ["TokenCheck", "engine_tokens", "first_difference"]

# what reaches the engine's chat template (streams.openai.ChatRequest), as /tokenize takes it
_CHAT_FIELDS = (
    "model",
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
)


async def engine_tokens(
    http: aiohttp.ClientSession,
    endpoint: str,
    p: ParsedRequest,
    timeout_s: float = 5.0,
    headers: Mapping[str, str] | None = None,
) -> list[int] | None:
    """The engine's token ids for ``p`` from its ``POST /tokenize`` (None: no answer)."""
    keys = _CHAT_FIELDS if p.chat else ("model", "prompt")
    body = {k: p.body[k] for k in keys if k in p.body}
    try:
        async with http.post(
            endpoint.rstrip("/") + "/tokenize",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            if r.status != 200:
                return None
            answer = orjson.loads(await r.read())
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        return None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        return None
    return tokens


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@dataclass(slots=True)
class TokenCheck:
    every: int = 100
    min_checks: int = 5
    max_mismatch_share: float = 0.2
    approximate: set[str] = field(default_factory=set)
    _seen: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    mismatches: Counter[str] = field(default_factory=Counter)

    def due(self, model: str) -> bool:
        """Whether this request of ``model`` is one to check (the first, then every Nth)."""
        if self.every <= 0 or model in self.approximate:
            return False
        self._seen[model] += 1
        return self._seen[model] % self.every == 1 or self.every == 1

    def record(self, model: str, matched: bool) -> bool:
        """One check's result; True when it made the model approximate."""
        self.checks[model] += 1
        if not matched:
            self.mismatches[model] += 1
        n = self.checks[model]
        if (
            model not in self.approximate
            and n >= self.min_checks
            and self.mismatches[model] / n > self.max_mismatch_share
        ):
            self.approximate.add(model)
            return True
        return False

    def agrees(self, model: str) -> bool:
        """Whether the engine's /tokenize has agreed with the router on ``model`` every time
        it was asked (at least once): the router's ids are the engine's."""
        return (
            self.checks[model] > 0 and not self.mismatches[model] and model not in self.approximate
        )

    def report(self) -> dict[str, dict[str, int | bool]]:
        return {
            m: {
                "checks": self.checks[m],
                "mismatches": self.mismatches[m],
                "approximate": m in self.approximate,
            }
            for m in self.checks
        }
