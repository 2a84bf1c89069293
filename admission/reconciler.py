"""The reconciler in a router: every ``reconcile_interval_s`` (one router at a time, by a lease
in the store), compare the KV ledger, the reservation store and the nodes' heartbeats, and fix
what :func:`admission.reconcile.plan_reconcile` says. After Redis lost its data it rebuilds the
store from the ledger before anything else is admitted (the store refuses reservations until
then)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from admission.exceptions import AdmissionError
from admission.gate import AdmissionGate
from admission.pools import budget_key
from admission.reconcile import ReconcilePlan, plan_reconcile
from admission.reservations import Reservation
from streams.background import Background
from streams.ledger import LedgerReplica
from streams.schemas import Heartbeat

__all__ = ["Reconciler", "idle_pools"]

log = logging.getLogger(__name__)


def idle_pools(beats: Iterable[Heartbeat], now: float) -> set[str]:
    """Budgets (admission.pools) whose every live node reports nothing running and nothing
    waiting."""
    busy: set[str] = set()
    seen: set[str] = set()
    for hb in beats:
        if now - hb.ts > hb.lease_s:
            continue
        key = budget_key(hb.pool, hb.model)
        seen.add(key)
        if hb.running or hb.waiting:
            busy.add(key)
    return seen - busy


@dataclass
class Reconciler(Background):
    gate: AdmissionGate
    ledger: LedgerReplica
    heartbeats: Callable[[], Iterable[Heartbeat]]
    interval_s: float = 1.0
    grace_s: float = 10.0
    sole_owner: bool = False  # the store is this router's alone (in-process backend)
    actions: dict[str, int] = field(default_factory=dict)
    runs: int = 0
    rebuilds: int = 0
    last_run_s: float | None = None
    _suspects: dict[str, float] = field(default_factory=dict)
    _idle_since: dict[str, float] = field(default_factory=dict)

    async def _run(self) -> None:
        await self.ledger.caught_up.wait()
        while True:
            try:
                await self.run_once(time.time())
                self.running_again()
            except AdmissionError as exc:
                log.warning("reconcile skipped: %s", exc)
            await asyncio.sleep(self.interval_s)

    def _idle(self, now: float) -> dict[str, float]:
        idle = idle_pools(self.heartbeats(), now)
        for pool in list(self._idle_since):
            if pool not in idle:
                del self._idle_since[pool]
        for pool in idle:
            self._idle_since.setdefault(pool, now)
        return dict(self._idle_since)

    async def run_once(self, now: float) -> ReconcilePlan | None:
        """One pass; None when another router reconciles or the ledger is not caught up."""
        if not self.ledger.caught_up.is_set():
            return None
        store = self.gate.store
        idle = self._idle(now)
        if not await store.lead(self.gate.router_id, 3 * self.interval_s + 1.0):
            return None
        reset = await store.generation() is None
        book = self.ledger.book
        plan = plan_reconcile(
            book.open,
            book.closed,
            await store.entries(),
            now,
            lease_s=self.gate.settings.lease_s,
            grace_s=self.grace_s,
            store_reset=reset,
            suspects=self._suspects,
            sole_owner=self.gate.router_id if self.sole_owner else None,
            own=self.gate.held,
            idle_since=idle,
        )
        await self._apply(plan, now)
        if reset:
            await store.mark_generation(uuid.uuid4().hex)
            self.rebuilds += 1
            log.warning(
                "reservation store was empty: rebuilt %d reservations from the ledger",
                len(plan.restore),
            )
        self._suspects = plan.suspects
        self.runs += 1
        self.last_run_s = now
        for k, v in plan.counts().items():
            self.actions[k] = self.actions.get(k, 0) + v
        if len(plan):
            log.warning("reconciled: %s", plan.counts())
        return plan

    async def _apply(self, plan: ReconcilePlan, now: float) -> None:
        store, gate = self.gate.store, self.gate
        for e in plan.restore:
            expires = e.lease_expires_at or e.ts + gate.settings.lease_s
            r = Reservation(e.reservation_id, e.pool, e.kv_blocks, e.slots, expires, e.tenant or "")
            await store.restore(r)
        for e, cause in plan.compensate:
            r = Reservation(e.reservation_id, e.pool, e.kv_blocks, e.slots, now, e.tenant or "")
            await gate.record("expire", r, now, f"reconciler: {cause}")
        for r in plan.adopt:
            await gate.record("reserve", r, now, "reconciler: held in the store, not on the ledger")
        for r in plan.drop:
            await store.release(r.reservation_id, now)
        for r in plan.orphans:
            if await store.release(r.reservation_id, now) is not None:
                gate.held.pop(r.reservation_id, None)
                await gate.record("expire", r, now, "reconciler: its pool's nodes are idle")

    def report(self, beats: Iterable[Heartbeat], now: float) -> dict[str, Any]:
        """The three views of every budget summed, side by side (the router's state endpoint
        shows it)."""
        live = [hb for hb in beats if now - hb.ts <= hb.lease_s]
        book = self.ledger.book.open.values()
        blocks, slots = sum(e.kv_blocks for e in book), sum(e.slots for e in book)
        return {
            "ledger_open": len(self.ledger.book.open),
            "ledger_kv_blocks": blocks,
            "ledger_slots": slots,
            "nodes_kv_blocks_used": sum(hb.kv_blocks_used for hb in live),
            "nodes_requests": sum(hb.running + hb.waiting for hb in live),
            "runs": self.runs,
            "rebuilds": self.rebuilds,
            "actions": dict(self.actions),
            "last_run_age_s": None if self.last_run_s is None else now - self.last_run_s,
        }
