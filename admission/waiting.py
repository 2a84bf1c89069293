"""The admission queue's waiting side: requests over their priority's watermark wait here
until the pump admits them (reserving for the queue's head as the budget allows), their
deadline passes or their client leaves. Decisions come from the pure :mod:`admission.queue`;
the gate (admission/gate.py) owns the store, the budget and the ledger."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from admission.core import Budget, Rejection, RejectReason, Verdict
from admission.plan import AdmissionAsk, quota_refusal, reserve_ask
from admission.preempt import make_room
from admission.queue import Waiting
from admission.reservations import TENANT_LIMIT, Reservation

if TYPE_CHECKING:
    from admission.gate import AdmissionGate

__all__ = ["Waiters"]


class Waiters:
    """The queued requests' futures and the pump that answers them, for one gate."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.futures: dict[Waiting, asyncio.Future[Verdict]] = {}
        self.lock = asyncio.Lock()

    async def wait(self, ask: AdmissionAsk, verdict: Verdict, b: Budget, now: float) -> Verdict:
        """Queue until the pump admits it, its deadline passes (its priority's queue timeout,
        at most its SLO class's TTFT) or the client leaves — having preempted sheddable work
        when it would miss that deadline otherwise."""
        tenant, request_id = ask.tenant, ask.request_id
        timeout = self.gate.settings.queue_timeout_s.get(tenant.priority, 0.0)
        if ask.ttft_deadline_s is not None:
            timeout = min(timeout, ask.ttft_deadline_s)
        w = Waiting(
            request_id,
            ask.pool,
            tenant.priority,
            verdict.kv_blocks,
            now,
            now + timeout,
            tenant,
            ask.resuming,
        )
        # a higher class that would miss its deadline takes sheddable work's room (preempt.py)
        b = make_room(self.gate.queues, w, b, self.gate.preemptible, now)
        refused = self.gate.queues.offer(w, b, now)
        if refused is not None:
            return replace(verdict, queue=False, rejection=refused)
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self.futures[w] = fut
        try:
            await self.pump(now)
            return await fut
        except asyncio.CancelledError:
            # admitted in the instant the client left: nobody will release it but us
            if fut.done() and not fut.cancelled() and fut.result().admitted:
                await self.gate.release(request_id, now)
            raise
        finally:
            if fut.cancelled() or not fut.done():  # the client went away while queued
                self.gate.queues.remove(w)
            self.futures.pop(w, None)

    async def pump(self, now: float) -> int:
        """Admit what the queues may let in now; refuse what waited past its deadline. It runs
        to its end even when its caller is cancelled (a pump that stopped between a waiter's
        reservation and its answer would leave that reservation to its lease)."""
        return await asyncio.shield(self._pump(now))

    async def _pump(self, now: float) -> int:
        admitted = 0
        async with self.lock:
            for gone in self.gate.queues.expired(now):
                fut = self.futures.get(gone)
                if fut is not None and not fut.done():
                    fut.set_result(
                        Verdict(
                            False,
                            gone.kv_blocks,
                            1.0,
                            Rejection(
                                RejectReason.QUEUE_TIMEOUT,
                                True,
                                self.gate.settings.min_retry_after_s,
                                f"waited {now - gone.enqueued_at:.1f} s "
                                f"in the {gone.priority} queue",
                            ),
                            queue_wait_s=max(0.0, now - gone.enqueued_at),
                        )
                    )
            pools = list(self.gate.queues.pools())
            capacity = self.gate.capacity
            now_blocks = capacity(now) if capacity is not None and pools else {}
            for pool in pools:
                blocks = now_blocks.get(pool, self.gate.node_blocks.get(pool, []))
                b = await self.gate.budget(pool, blocks, now)
                while (head := self.gate.queues.admissible(pool, b, now)) is not None:
                    t = head.tenant or self.gate.settings.anonymous
                    t_blocks, t_slots, why = await self.gate.tenant_limits(t, pool, b, 1.0, now)
                    plan = reserve_ask(
                        head.request_id,
                        t.name,
                        head.priority,
                        pool,
                        head.kv_blocks,
                        b,
                        self.gate.settings,
                        t_blocks,
                        t_slots,
                    )
                    r = await self.gate.store.try_reserve(plan, now)
                    if r == TENANT_LIMIT:  # over its share: refused, the queue moves on
                        self.gate.wanting(t, now)
                        self.gate.queues.remove(head)
                        fut = self.futures.get(head)
                        if fut is not None and not fut.done():
                            fut.set_result(
                                quota_refusal(
                                    t, why, head.kv_blocks, b.usage_after(0), self.gate.settings
                                )
                            )
                        continue
                    if not isinstance(r, Reservation):  # another router took the room first
                        break
                    self.gate.queues.remove(head)
                    await self.gate.hold(r, now)
                    admitted += 1
                    b = replace(b, kv_blocks_reserved=b.kv_blocks_reserved + r.kv_blocks)
                    fut = self.futures.get(head)
                    if fut is not None and not fut.done():
                        fut.set_result(
                            Verdict(
                                True,
                                head.kv_blocks,
                                b.usage_after(0),
                                # (callers pass their own clock reading, which may be older
                                # than a newer waiter's arrival: a wait is never negative)
                                queue_wait_s=max(0.0, now - head.enqueued_at),
                                local_share=r.local,
                            )
                        )
                    elif fut is None or fut.cancelled():  # nobody waits for it any more
                        await self.gate.release(head.request_id, now)
        return admitted

    async def run(self, clock: Callable[[], float]) -> None:
        """Re-check the queues every ``queue_poll_s`` (other routers release room too)."""
        while True:
            await asyncio.sleep(self.gate.settings.queue_poll_s)
            if len(self.gate.queues):
                with contextlib.suppress(Exception):
                    await self.pump(clock())
