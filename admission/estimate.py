"""The expected output of a request, learned per tenant and model (pure).

Clients send ``max_tokens`` as an upper bound (often a default like 4096); reserving KV for all
of it would fill the budget with blocks nobody uses. The estimate is a high quantile (default
p90) of the output lengths recently seen for the same tenant and model; a request reserves for
``min(max_tokens, estimate)``. Until ``min_samples`` outcomes are in, the configured cap is used.
Every decision records the estimate and every outcome the actual length, so the estimator can be
judged afterwards (ClickHouse).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["OutputEstimator"]


@dataclass(slots=True)
class _Series:
    values: deque[int]
    estimate: int | None = None
    since: int = 0  # observations since the estimate was computed


@dataclass(slots=True)
class OutputEstimator:
    quantile: float = 0.9
    window: int = 500
    min_samples: int = 20
    refresh_every: int = 10
    max_keys: int = 10_000
    _series: dict[tuple[str, str], _Series] = field(default_factory=dict)

    def observe(self, tenant: str, model: str, output_tokens: int) -> None:
        key = (tenant, model)
        s = self._series.get(key)
        if s is None:
            if len(self._series) >= self.max_keys:
                self._series.pop(next(iter(self._series)))
            s = self._series[key] = _Series(deque(maxlen=self.window))
        s.values.append(max(0, output_tokens))
        s.since += 1
        if len(s.values) >= self.min_samples and (
            s.estimate is None or s.since >= self.refresh_every
        ):
            ordered = sorted(s.values)
            s.estimate = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
            s.since = 0

    def estimate(self, tenant: str, model: str) -> int | None:
        s = self._series.get((tenant, model))
        return None if s is None else s.estimate

    def expected(self, tenant: str, model: str, max_tokens: int, cap: int) -> int:
        """Output tokens to reserve KV for."""
        est = self.estimate(tenant, model)
        return min(max_tokens, est if est is not None else cap)
