"""Agent sessions as ``kvgate bench agentic`` replays them: the schedules (sessions started one
after another, or a number of them at once) and what a run gave its users and its GPUs."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

from analytics.sim.metrics import pct
from analytics.sim.simconfig import Done
from analytics.sim.traces import Trace, TraceRequest

__all__ = ["SLOW_SESSION_S", "agentic_metrics", "sessions_at_once", "sessions_started"]


SLOW_SESSION_S = 30.0  # a session whose turns' median TTFT is longer is counted as slow


def agentic_metrics(done: list[Done], requests: int, nodes: int) -> dict[str, float | int]:
    """What a run gave its users and its GPUs (analytics/sim/agenticbench.py's docstring says
    what each figure is)."""
    if not done:
        return {"completed": 0, "refused": requests}
    start = min(d.request.arrival_s for d in done)
    end = max(d.finish_s for d in done)
    output = sum(d.request.output_tokens for d in done)
    speeds = [
        d.request.output_tokens / max(1e-9, d.finish_s - d.first_token_s)
        for d in done
        if d.request.output_tokens > 1
    ]
    ttft = [d.first_token_s - d.request.arrival_s for d in done]
    prompt = sum(d.request.prompt_tokens for d in done)
    per_session: dict[str | None, list[float]] = {}
    for d, t in zip(done, ttft, strict=True):
        per_session.setdefault(d.request.session_id, []).append(t)
    slow = sum(statistics.median(ts) > SLOW_SESSION_S for ts in per_session.values())
    # a session's context is alive from its first turn's arrival to its last turn's end, as
    # large as its longest prompt: the most KV the sessions alive at once could keep
    alive: dict[str | None, tuple[float, float, int]] = {}
    for d in done:
        a, b, t = alive.get(d.request.session_id, (d.request.arrival_s, d.finish_s, 0))
        alive[d.request.session_id] = (
            min(a, d.request.arrival_s),
            max(b, d.finish_s),
            max(t, d.request.prompt_tokens),
        )
    changes = sorted(
        [(a, t) for a, _, t in alive.values()] + [(b, -t) for _, b, t in alive.values()],
        key=lambda c: (c[0], c[1]),  # an end before a start at the same time
    )
    level = peak = 0
    for _, t in changes:
        level += t
        peak = max(peak, level)
    return {
        "completed": len(done),
        "refused": requests - len(done),
        "span_s": round(end - start, 1),
        "tok_s_per_gpu": round(output / max(1e-9, end - start) / nodes, 2),
        "tok_s_per_user": round(statistics.median(speeds), 2) if speeds else 0.0,
        "hit_rate": round(sum(d.cached_tokens for d in done) / max(1, prompt), 4),
        "ttft_p50_s": round(pct(ttft, 0.5) or 0.0, 3),
        "ttft_p99_s": round(pct(ttft, 0.99) or 0.0, 3),
        "slow_sessions": slow,
        "contexts_peak_tokens": peak,
    }


def sessions_started(trace: Trace, sessions_per_s: float, seed: int) -> Trace:
    """The trace with its sessions starting one after another at ``sessions_per_s`` (AIPerf's
    trace starts them all at 0: AIPerf schedules sessions when it runs). Repetition ``seed``
    moves each start by up to 0.4 of the spacing (seed 0: evenly spaced). Every turn of a
    session moves with its first, so a session's turns stay in order: the closed loop sends a
    later turn when the one before it in the trace ends (analytics/sim/cluster.py), and a later
    turn sorted ahead of its session's first would arrive on its own, at its recorded time."""
    rng = random.Random(seed)
    first: dict[str | None, float] = {}
    for r in trace.requests:
        if r.think_s is None:
            first.setdefault(r.session_id, r.arrival_s)
    shift = {
        sid: max(0.0, (k + (rng.uniform(-0.4, 0.4) if seed else 0.0)) / sessions_per_s) - at
        for k, (sid, at) in enumerate(first.items())
    }
    moved = [
        replace(r, arrival_s=r.arrival_s + shift.get(r.session_id, 0.0)) for r in trace.requests
    ]
    return replace(trace, requests=tuple(sorted(moved, key=lambda r: r.arrival_s)))


def sessions_at_once(trace: Trace, slots: int) -> Trace:
    """The trace as a client running ``slots`` sessions at once runs it (AIPerf's
    ``--concurrency``): the first ``slots`` sessions start at 0, and session *k* starts as soon
    as session *k* − ``slots`` has ended (each slot runs its sessions one after another)."""
    turns: dict[str | None, list[TraceRequest]] = {}
    for r in trace.requests:
        turns.setdefault(r.session_id, []).append(r)
    order = list(turns)
    out: list[TraceRequest] = []
    for k, sid in enumerate(order):
        first, *later = turns[sid]
        if k < slots:
            first = replace(first, arrival_s=0.0)
        else:
            first = replace(first, think_s=0.0, after_session=order[k - slots])
        out += [first, *later]
    return replace(trace, requests=tuple(out))
