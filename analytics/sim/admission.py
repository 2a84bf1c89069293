"""Admission control in virtual time: the same pure core and queues as the live gate.

The live gate keeps reservations in a store behind an async interface; here the in-process
store itself (one router) is driven synchronously — its coroutines never suspend. Decisions —
cost, watermarks, priorities, queueing (with its aging term), Retry-After, preemption — come
from :mod:`admission.core`, :mod:`admission.queue` and :mod:`admission.preempt`.
"""

from __future__ import annotations

import math
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from admission.core import Budget, Rejection, RejectReason, admit
from admission.plan import contended, quota_refusal, reserve_ask, tenant_caps
from admission.preempt import Preemptible, make_room
from admission.queue import AdmissionQueues, Waiting
from admission.reservations import TENANT_LIMIT, InProcessReservations, ReserveAsk
from admission.settings import AdmissionSettings, Priority, Tenant
from admission.storm import InProcessStormStore, StormGuard

__all__ = ["Refused", "SimAdmission"]

POOL = "default"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Refused:
    index: int  # the request's position in the trace
    priority: str
    reason: RejectReason
    retry_after_s: float | None
    at_s: float
    attempt: int = 1
    final: bool = True  # the client gave up (no retry follows)


def _now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the in-process stores) to its result."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise RuntimeError("the coroutine suspended; only in-process stores can run here")


@dataclass(slots=True)
class SimAdmission:
    settings: AdmissionSettings
    kv_blocks_total: int
    node_blocks: int
    slots_total: int
    block_size: int
    queues: AdmissionQueues = field(init=False)
    store: InProcessReservations = field(default_factory=InProcessReservations)
    _waiting: dict[str, tuple[Waiting, int]] = field(default_factory=dict)
    storm_guard: bool = False
    _clock: float = 0.0
    _guard: StormGuard | None = None
    tenants: dict[str, Tenant] = field(init=False)
    weights: dict[str, float] = field(init=False)
    asked: dict[str, float] = field(init=False)
    hungry: dict[str, float] = field(init=False)
    preemptible: Preemptible | None = None  # the engines' sheddable work (admission/preempt.py)

    def __post_init__(self) -> None:
        self.queues = AdmissionQueues(self.settings)
        # a trace's clients named as configured tenants are those tenants (their caps, weights
        # and fair share, as the live gate applies them); other clients: no tenant limits
        self.tenants = {t.name: t for t in self.settings.tenants.values()}
        self.weights = {t.name: t.weight for t in self.tenants.values()}
        self.asked: dict[str, float] = {}  # tenant -> when it last asked (fair share's window)
        self.hungry: dict[str, float] = {}  # tenant -> when it was last refused or queued
        if self.storm_guard:
            self._guard = StormGuard(
                InProcessStormStore(clock=lambda: self._clock),
                self.settings.retry_guard_window_s,
                self.settings.retry_guard_max_s,
                self.settings.retry_guard_client_burst,
            )

    def early_retry(
        self, client: str, attempt: str, index: int, priority: str, now: float
    ) -> Refused | None:
        """The storm guard's refusal of an attempt retried before its Retry-After, or of a
        client's new request while it should be backing off."""
        if self._guard is None:
            return None
        self._clock = now
        rej = _now(self._guard.check(client, attempt, now))
        if rej is None and self.settings.retry_guard_new_requests == "all":
            # simulated clients are tenants; the default guards anonymous addresses only
            rej = _now(self._guard.check_client(client, now))
        return None if rej is None else self._refused(index, priority, rej, now)

    def remember(self, attempt: str, refused: Refused, now: float, client: str) -> None:
        if self._guard is not None:
            self._clock = now
            rej = Rejection(refused.reason, True, refused.retry_after_s, "")
            guarded = self.settings.retry_guard_new_requests == "all"
            _now(self._guard.refused(attempt, rej, now, client if guarded else None))

    def budget(self, now: float) -> Budget:
        held_blocks, held_slots, drain = _now(self.store.snapshot(POOL, now))
        return Budget(
            self.kv_blocks_total,
            self.slots_total,
            held_blocks,
            held_slots,
            self.node_blocks,
            drain,
        )

    def arrive(
        self,
        index: int,
        rid: str,
        priority: Priority,
        prompt_tokens: int,
        max_tokens: int,
        now: float,
        ttft_deadline_s: float | None = None,
        client: str = "",
    ) -> bool | Refused:
        """True: admitted now; False: queued (at most ``ttft_deadline_s``, its SLO class's
        TTFT); or the refusal. ``client``: a configured tenant's name, or anyone."""
        tenant = self.tenants.get(client)
        if tenant is not None:
            self.asked[tenant.name] = now
        b = self.budget(now)
        v = admit(prompt_tokens, max_tokens, self.block_size, priority, b, self.settings)
        if self.queues.waiting_at_or_above(POOL, priority, now):
            v = self.queues.hold(v, priority, self.settings)
        if tenant is not None and not v.admitted:
            self.hungry[tenant.name] = now  # refused or queued: it wants more (as live)
        if v.admitted:
            over = self._reserve(rid, v.kv_blocks, tenant, priority, b, v.usage_after, now)
            return True if over is None else self._refused(index, priority, over, now)
        if v.queue:
            timeout = self.settings.queue_timeout_s.get(priority, 0.0)
            if ttft_deadline_s is not None:
                timeout = min(timeout, ttft_deadline_s)
            deadline = now + timeout
            w = Waiting(rid, POOL, priority, v.kv_blocks, now, deadline, tenant)
            b = make_room(self.queues, w, b, self.preemptible, now)  # (as the live gate)
            refused = self.queues.offer(w, b, now)
            if refused is None:
                self._waiting[rid] = (w, index)
                return False
            return self._refused(index, priority, refused, now)
        assert v.rejection is not None
        return self._refused(index, priority, v.rejection, now)

    def release(self, rid: str, now: float) -> None:
        _now(self.store.release(rid, now))

    def pump(self, now: float) -> tuple[list[tuple[int, float]], list[Refused]]:
        """Queued requests admitted now (index, wait) and the ones that ran out of time."""
        refused = []
        for w in self.queues.expired(now):
            _, index = self._waiting.pop(w.request_id)
            rej = Rejection(RejectReason.QUEUE_TIMEOUT, True, self.settings.min_retry_after_s, "")
            refused.append(self._refused(index, w.priority, rej, now))
        admitted = []
        b = self.budget(now)
        while (head := self.queues.admissible(POOL, b, now)) is not None:
            self.queues.remove(head)
            _, index = self._waiting.pop(head.request_id)
            over = self._reserve(
                head.request_id, head.kv_blocks, head.tenant, head.priority, b, 1.0, now
            )
            if over is not None:  # over its share: refused, the queue moves on (as live)
                refused.append(self._refused(index, head.priority, over, now))
                continue
            admitted.append((index, now - head.enqueued_at))
            b = self.budget(now)
        return admitted, refused

    def _reserve(
        self,
        rid: str,
        blocks: int,
        tenant: Tenant | None = None,
        priority: Priority = "normal",
        b: Budget | None = None,
        usage_after: float = 0.0,
        now: float = 0.0,
    ) -> Rejection | None:
        """Reserve (the verdict already checked the pool's limits on this same snapshot: one
        router); a tenant's own caps and fair share as the live gate checks them (None: held;
        else the tenant's refusal)."""
        if tenant is None or b is None:
            self.store.reserve(ReserveAsk(rid, POOL, blocks, self.kv_blocks_total, math.inf), 0.0)
            return None
        s = self.settings
        usage = _now(self.store.tenant_usage(POOL)) if contended(s, usage_after) else None
        window = s.fair_share_window_s
        asking = {t for t, at in self.asked.items() if now - at <= window}
        hungry = {t for t, at in self.hungry.items() if now - at <= window}
        t_blocks, t_slots, why = tenant_caps(tenant, b, usage, asking, self.weights, s, hungry)
        plan = reserve_ask(rid, tenant.name, priority, POOL, blocks, b, s, t_blocks, t_slots)
        # (the pool's limits were checked on the snapshot; virtual time renews nothing)
        plan = replace(plan, limit_blocks=self.kv_blocks_total, limit_slots=None, lease_s=math.inf)
        if self.store.reserve(plan, 0.0) == TENANT_LIMIT:
            self.hungry[tenant.name] = now
            rej = quota_refusal(tenant, why, blocks, usage_after, s).rejection
            assert rej is not None
            return rej
        return None

    def refuse_admitted(
        self, index: int, rid: str, priority: str, rej: Rejection, now: float
    ) -> Refused:
        """An admitted request refused after all (its SLO class's TTFT cannot be met): its
        reservation goes back."""
        self.release(rid, now)
        return self._refused(index, priority, rej, now)

    @staticmethod
    def _refused(index: int, priority: str, rej: Rejection, now: float) -> Refused:
        return Refused(index, priority, rej.reason, rej.retry_after_s, now)
