"""Preemption of sheddable work before its first token (pure; the live gate and the simulator
apply it alike).

Admitted requests of a sheddable priority (``preempt_priorities``, low by default) that have
not produced their first token may be ended for a request of a higher class that would
otherwise miss its deadline: their prefill is the only work lost, and they get a typed refusal
(503 ``preempted``, with Retry-After) instead of being served at the expense of a class above
them. Two places decide it:

* admission (:func:`victims`): the request must queue and would wait past its deadline (its
  expected wait, :meth:`admission.queue.AdmissionQueues.expected_wait_s`): the KV budget the
  sheddable work holds makes its room;
* routing (:func:`deadline_victims`, router/decision/pipeline.py): its best node's expected
  time to first token would pass its SLO class's TTFT: the sheddable work queued on that node
  ahead of it is what makes it late.

The newest are preempted first (the least waited), and only as many as make the room or the
time; when even all of them would not, none is: a preemption that does not let the request in
on time only loses work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from admission.core import Budget, Rejection, RejectReason, priority_limit, retry_after
from admission.queue import ORDER, AdmissionQueues, Waiting
from admission.settings import AdmissionSettings, Priority

__all__ = [
    "Preemptible",
    "Running",
    "deadline_victims",
    "freed",
    "make_room",
    "preempted",
    "victims",
]


@dataclass(frozen=True, slots=True)
class Running:
    """An admitted request that may still be preempted (no first token yet)."""

    request_id: str
    priority: Priority
    kv_blocks: int
    admitted_at: float
    node: str = ""  # where it was sent
    prefill_tokens: int = 0  # the prompt tokens its node computes before its first token


class Preemptible(Protocol):
    """Who serves the admitted requests (the router's flights; the simulated engines)."""

    def running(self, pool: str) -> list[Running]:
        """The requests in ``pool`` that have not produced their first token."""
        ...

    def on_node(self, node: str) -> list[Running]:
        """The requests sent to ``node`` that have not produced their first token."""
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
    limit = priority_limit(w.priority, s)
    need_blocks = b.kv_blocks_reserved + ahead[0] + w.kv_blocks - limit * b.kv_blocks_total
    need_slots = b.slots_reserved + ahead[1] + 1 - limit * b.slots_total
    chosen: list[Running] = []
    blocks = slots = 0
    for r in _sheddable_below(w.priority, running, s):
        if blocks >= need_blocks and slots >= need_slots:
            break
        chosen.append(r)
        blocks += r.kv_blocks
        slots += 1
    if blocks < need_blocks or slots < need_slots:
        return []
    return chosen


def _sheddable_below(
    priority: Priority, running: Sequence[Running], s: AdmissionSettings
) -> list[Running]:
    """``running``'s sheddable requests of a lower class than ``priority``, newest first."""
    rank = ORDER.index(priority)
    pool = [
        r for r in running if r.priority in s.preempt_priorities and ORDER.index(r.priority) > rank
    ]
    return sorted(pool, key=lambda r: (-r.admitted_at, r.request_id))


def deadline_victims(
    priority: Priority,
    late_s: float,
    prefill_tokens_per_s: float | None,
    running: Sequence[Running],
    s: AdmissionSettings,
) -> list[Running]:
    """The requests to preempt on a node so that a request of ``priority`` that would be
    ``late_s`` past its class's TTFT there (behind the prefill queued on it, which the node
    computes at ``prefill_tokens_per_s``) meets it: sheddable requests of lower classes not
    yet answered on that node (``running``), newest first, whose prefill takes at least that
    long. None when preemption is off, the node's rate is unknown, or they could not save
    the time."""
    if not s.preemption or late_s <= 0 or not prefill_tokens_per_s:
        return []
    chosen: list[Running] = []
    saved = 0.0
    for r in _sheddable_below(priority, running, s):
        if saved >= late_s:
            break
        if r.prefill_tokens > 0:
            chosen.append(r)
            saved += r.prefill_tokens / prefill_tokens_per_s
    return chosen if saved >= late_s else []


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
