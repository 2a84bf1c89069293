"""The router's tokenization, checked against the engine's (pure).

One request in ``every`` of a model with a configured tokenizer is also sent to its engine's
``POST /tokenize`` (vLLM and SGLang have one); a different token list is a mismatch. Once at least
``min_checks`` were made and more than ``max_mismatch_share`` of them disagreed, the model's
tokenization is marked approximate: its hashes cannot be the engine's, so the router stops
claiming exact hits for it and its decisions say ``approximate_tokens``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["TokenCheck"]


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

    def report(self) -> dict[str, dict[str, int | bool]]:
        return {
            m: {
                "checks": self.checks[m],
                "mismatches": self.mismatches[m],
                "approximate": m in self.approximate,
            }
            for m in self.checks
        }
