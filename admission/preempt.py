"""Preemption of sheddable work before its first token (pure; the live gate and the simulator
apply it alike).

A request of a higher priority that must queue and would miss its deadline there (its
expected wait, :meth:`admission.queue.AdmissionQueues.expected_wait_s`, runs past it) may take
the room of admitted requests of a sheddable priority (``preempt_priorities``, low by default)
that have not produced their first token: their prefill is the only work lost, and they get a
typed refusal (503 ``preempted``, with Retry-After) instead of being served late at the
expense of a class above them. The newest are preempted first (the least waited), and only as
many as make the room; when even all of them would not, none is: a preemption that does not
let the request in only loses work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from admission.core import Budget, Rejection, RejectReason, priority_limit, retry_after
from admission.queue import ORDER, AdmissionQueues, Waiting
from admission.settings import AdmissionSettings, Priority

__all__ = ["Preemptible", "Running", "freed", "make_room", "preempted", "victims"]


@dataclass(frozen=True, slots=True)
class Running:
    """An admitted request that may still be preempted (no first token yet)."""

    request_id: str
    priority: Priority
    kv_blocks: int
    admitted_at: float


class Preemptible(Protocol):
    """Who serves the admitted requests (the router's flights; the simulated engines)."""

    def running(self, pool: str) -> list[Running]:
        """The requests in ``pool`` that have not produced their first token."""
        ...

    def preempt(self, request_id: str, rejection: Rejection) -> bool:
        """End it now with ``rejection``; False when it can no longer be (it answered)."""
        ...


def victims(
    w: Waiting,
    running: Sequence[Running],
    b: Budget,
    ahead: tuple[int, int],
    wait_s: float,
    now: float,
    s: AdmissionSettings,
) -> list[Running]:
    """The requests to preempt so that ``w`` enters before its deadline: none when it would
    make its deadline anyway (``wait_s``, its expected wait behind ``ahead``: the KV blocks and
    requests queued at its class and above), when preemption is off, or when the sheddable
    work of lower classes could not make the room."""
    if not s.preemption or now + wait_s <= w.deadline:
        return []
    rank = ORDER.index(w.priority)
    pool = [
        r for r in running if r.priority in s.preempt_priorities and ORDER.index(r.priority) > rank
    ]
    limit = priority_limit(w.priority, s)
    need_blocks = b.kv_blocks_reserved + ahead[0] + w.kv_blocks - limit * b.kv_blocks_total
    need_slots = b.slots_reserved + ahead[1] + 1 - limit * b.slots_total
    chosen: list[Running] = []
    blocks = slots = 0
    for r in sorted(pool, key=lambda r: (-r.admitted_at, r.request_id)):
        if blocks >= need_blocks and slots >= need_slots:
            break
        chosen.append(r)
        blocks += r.kv_blocks
        slots += 1
    if blocks < need_blocks or slots < need_slots:
        return []
    return chosen


def freed(b: Budget, gone: Sequence[Running]) -> Budget:
    """The budget once ``gone``'s reservations are back."""
    return replace(
        b,
        kv_blocks_reserved=max(0, b.kv_blocks_reserved - sum(r.kv_blocks for r in gone)),
        slots_reserved=max(0, b.slots_reserved - len(gone)),
    )


def preempted(for_priority: Priority, wait_s: float, s: AdmissionSettings) -> Rejection:
    """What a preempted request's client hears: retry once the work it made room for could
    have drained (``wait_s``: how long that request was expected to wait)."""
    seconds = wait_s if math.isfinite(wait_s) else s.max_retry_after_s
    return Rejection(
        RejectReason.PREEMPTED,
        True,
        retry_after(seconds, s),
        f"preempted before its first token for {for_priority} priority work",
    )


def make_room(
    queues: AdmissionQueues,
    w: Waiting,
    b: Budget,
    who: Preemptible | None,
    now: float,
) -> Budget:
    """Preempt what :func:`victims` names for ``w`` (through ``who``); the budget as ``w`` may
    count on it (the preempted reservations back: their release follows)."""
    s = queues.settings
    if who is None or not s.preemption:
        return b
    wait = queues.expected_wait_s(w.pool, w.priority, w.kv_blocks, b)
    chosen = victims(w, who.running(w.pool), b, queues.ahead(w.pool, w.priority), wait, now, s)
    if not chosen:
        return b
    rej = preempted(w.priority, wait, s)
    return freed(b, [r for r in chosen if who.preempt(r.request_id, rej)])
