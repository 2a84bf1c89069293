"""The search behind ``kvgate plan``: the fewest replicas whose simulated SLO attainment reaches
the target, found in few simulations.

It starts from an analytic estimate (:func:`estimate_replicas`: the engines' time per request
at a batch the TPOT target allows), then moves up by half again, or down by a quarter, until it
brackets the answer, and bisects. Going up, a count that misses the target still counts as
progress while its attainment, TTFT or TPOT improves (a fleet far too small misses every
request, yet its TTFT halves at each step); the search stops short only when a step up improves
none of them — the requests' own service time misses the SLO, and more replicas cannot fix it —
or at the stated limit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from agents.profile import EngineProfile, idle_ttft_s
from analytics.sim.traces import Trace, TraceRequest

__all__ = ["PLATEAU", "Sizing", "alone", "estimate_replicas", "improved", "size_fleet"]

PLATEAU = 0.003  # a step up gains less attainment than this, and no latency: out of reach
LATENCY_GAIN = 0.9  # a step up that brings TTFT or TPOT (p50 or p99) below 90 % is progress
UTILISATION = 0.7  # the share of an engine's time the estimate plans to use
UP, DOWN = 1.5, 0.75  # the search's steps while it brackets the answer


@dataclass
class Sizing:
    """The answer (None: none found), every count simulated, and why the search ended."""

    replicas: int | None
    tried: dict[int, dict[str, Any]] = field(default_factory=dict)
    why: Literal["met", "plateau", "limit", "alone"] = "met"
    start: int = 1


def _latencies(r: dict[str, Any]) -> list[float | None]:
    return [r.get(k) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")]


def improved(bigger: dict[str, Any], smaller: dict[str, Any]) -> bool:
    """Whether the bigger fleet did better than the smaller one by more than noise: more
    attainment, or a TTFT or TPOT (p50 or p99) below :data:`LATENCY_GAIN` of the smaller's.
    A fleet that completed requests where the smaller one completed none improved too."""
    a1, a0 = bigger.get("slo_attainment") or 0.0, smaller.get("slo_attainment") or 0.0
    if a1 >= a0 + PLATEAU:
        return True
    for new, old in zip(_latencies(bigger), _latencies(smaller), strict=True):
        if new is not None and (old is None or new < LATENCY_GAIN * old):
            return True
    return False


def size_fleet(
    evaluate: Callable[[int], dict[str, Any]],
    target: float,
    max_replicas: int,
    start: int = 1,
    progress: Callable[[int, dict[str, Any]], None] | None = None,
) -> Sizing:
    """The smallest count whose ``slo_attainment`` ≥ ``target``, from ``start`` (every count
    evaluated once; ``progress`` is told each as it is done)."""
    out = Sizing(None, start=max(1, min(start, max_replicas)))
    tried = out.tried

    def result(n: int) -> dict[str, Any]:
        if n not in tried:
            tried[n] = evaluate(n)
            if progress is not None:
                progress(n, tried[n])
        return tried[n]

    def meets(n: int) -> bool:
        return float(result(n).get("slo_attainment") or 0.0) >= target

    n = out.start
    if meets(n):
        lo, hi = 0, n
        while hi > 1:  # down by a quarter until a count misses
            m = min(hi - 1, max(1, math.floor(hi * DOWN)))
            if not meets(m):
                lo = m
                break
            hi = m
    else:
        lo = n
        while True:  # up by half again until a count meets it
            if lo >= max_replicas:
                out.why = "limit"
                return out
            m = min(max_replicas, max(lo + 1, math.ceil(lo * UP)))
            if meets(m):
                hi = m
                break
            if not improved(result(m), result(lo)):
                out.why = "plateau"
                return out
            lo = m
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    out.replicas = hi
    return out


def _decode_batch(profile: EngineProfile, context_tokens: float, tpot_s: float) -> int:
    """The most sequences one engine decodes at once with steps within ``tpot_s`` (each
    reading ``context_tokens`` of KV), its sequence and KV limits included."""
    kv = profile.num_gpu_blocks * profile.block_size
    most = max(1, min(profile.max_num_seqs, int(kv // max(1.0, context_tokens))))
    if profile.step_time_s(1, int(context_tokens), 0) > tpot_s:
        return most  # no batch keeps within it: the engine runs full batches regardless
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if profile.step_time_s(mid, int(mid * context_tokens), 0) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _measured_hits(trace: Trace, measure_from_s: float) -> Iterator[tuple[TraceRequest, int]]:
    """Each request arriving ``measure_from_s`` or later after the first, with the prompt
    blocks an unbounded cache of every block computed before it would hold."""
    if not trace.requests:
        return
    cache: set[int] = set()
    since = trace.requests[0].arrival_s + measure_from_s
    for r in trace.requests:
        hit = 0
        for h in r.block_hashes:
            if h not in cache:
                break
            hit += 1
        cache.update(r.block_hashes)
        cache.update(r.output_block_hashes)
        if r.arrival_s >= since:
            yield r, hit


def estimate_replicas(
    profile: EngineProfile, trace: Trace, rate: float, tpot_s: float, measure_from_s: float = 0.0
) -> int:
    """Replicas that serve ``rate`` requests/s of ``trace``'s measured requests at
    :data:`UTILISATION`: each costs an engine the prefill of what an unbounded cache would not
    hold of its prompt, and its share of decode steps at the largest batch whose steps stay
    within the TPOT target. A starting point for the simulated search, not an answer."""
    rows = [
        (r.prompt_tokens, max(1, r.output_tokens), hit)
        for r, hit in _measured_hits(trace, measure_from_s)
    ]
    if not rows or rate <= 0:
        return 1
    bs = trace.block_size
    prompt = statistics.fmean(p for p, _, _ in rows)
    output = statistics.fmean(o for _, o, _ in rows)
    uncached = statistics.fmean(max(1, p - hit * bs) for p, _, hit in rows)
    context = prompt + output / 2
    batch = _decode_batch(profile, context, tpot_s)
    step = profile.step_time_s(batch, int(batch * context), 0)
    per_request_s = uncached / profile.prefill_tokens_per_s + output * step / batch
    return max(1, math.ceil(rate * per_request_s / UTILISATION))


def alone(
    profile: EngineProfile,
    trace: Trace,
    ttft_s: float,
    tpot_s: float,
    measure_from_s: float = 0.0,
) -> dict[str, float]:
    """The share of ``trace``'s requests that would meet each target alone on an idle replica
    whose cache holds every block computed before it (only the rest of the prompt prefilled;
    decode at a batch of one at its mean context): no fleet does better, so when ``both`` is
    below the attainment target no fleet meets the SLO. Only the requests that
    arrive ``measure_from_s`` after the first count (the earlier ones are their sessions'
    earlier turns)."""
    ttft_ok = tpot_ok = both = n = 0
    seen: dict[int, bool] = {}
    bs = trace.block_size
    for r, hit in _measured_hits(trace, measure_from_s):
        n += 1
        uncached = max(1, r.prompt_tokens - hit * bs)
        fast = seen.get(uncached)
        if fast is None:
            fast = seen[uncached] = idle_ttft_s(profile, uncached) <= ttft_s
        context = r.prompt_tokens + r.output_tokens // 2
        steady = r.output_tokens <= 1 or profile.step_time_s(1, context, 0) <= tpot_s
        ttft_ok += fast
        tpot_ok += steady
        both += fast and steady
    if not n:
        return {"ttft": 1.0, "tpot": 1.0, "both": 1.0}
    return {"ttft": ttft_ok / n, "tpot": tpot_ok / n, "both": both / n}
