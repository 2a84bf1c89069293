"""The reconciler in a router: every ``reconcile_interval_s`` (one router at a time, by a lease
in the store), compare the KV ledger, the reservation store and the nodes' heartbeats, and fix
what :func:`admission.reconcile.plan_reconcile` says. After Redis lost its data it rebuilds the
store from the ledger before anything else is admitted (the store refuses reservations until
then).

Only a router that reconciles follows the ledger: it carries every router's reservation events,
and followed by every router it would cost each one the whole cluster's request rate. The
others ask the store each interval who leads; when nobody does (the leader stopped and its
lease ran out, or the store lost its data) they start following, and the first one caught up
takes the lead. A router keeps following for ``standby_s`` after it last led or found the lead
free, then stops. Every router also says each interval that it is here (``store.present``):
how many routers share the store sizes each one's share of the budget while the store is away
(admission/failover.py)."""

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
    standby_s: float = 30.0  # follows the ledger this long after it last led or saw no leader
    routers_window_s: float = 600.0  # routers seen this recently share the budget
    routers_seen: int = 1  # routers using the store (the last count it gave)
    actions: dict[str, int] = field(default_factory=dict)
    runs: int = 0
    rebuilds: int = 0
    last_run_s: float | None = None
    _suspects: dict[str, float] = field(default_factory=dict)
    _idle_since: dict[str, float] = field(default_factory=dict)
    _wanted_at: float | None = None  # when it last led, or found nobody leading

    async def _run(self) -> None:
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

    async def _count_routers(self, now: float) -> None:
        """This router is here; how many use the store (the last count while it is away)."""
        if self.sole_owner:
            return
        try:
            self.routers_seen = await self.gate.store.present(
                self.gate.router_id, now, self.routers_window_s
            )
        except AdmissionError:
            pass

    async def _stand_by(self, now: float) -> bool:
        """Whether this router may reconcile: it follows the ledger while it leads or nobody
        does, and ``standby_s`` after; otherwise it stops following (the module's docstring)."""
        if self.sole_owner:
            wanted = True
        else:
            holder = await self.gate.store.leader()
            if holder is None or holder == self.gate.router_id:
                self._wanted_at = now
            wanted = self._wanted_at is not None and now - self._wanted_at <= self.standby_s
        if wanted and not self.ledger.running:
            log.info("following the ledger (to reconcile)")
            await self.ledger.start()
        elif not wanted and self.ledger.running:
            log.info("another router reconciles: no longer following the ledger")
            await self.ledger.stop()
        return wanted

    @property
    def following(self) -> bool:
        return self.ledger.running

    async def run_once(self, now: float) -> ReconcilePlan | None:
        """One pass; None when another router reconciles or the ledger is not caught up."""
        store = self.gate.store
        idle = self._idle(now)
        await self._count_routers(now)
        if not await self._stand_by(now) or not self.ledger.caught_up.is_set():
            return None
        if not await store.lead(self.gate.router_id, 3 * self.interval_s + 1.0):
            return None
        self._wanted_at = now
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
        # the ledger as this router follows it (None: another router reconciles)
        caught_up = self.following and self.ledger.caught_up.is_set()
        book = self.ledger.book.open.values()
        blocks, slots = sum(e.kv_blocks for e in book), sum(e.slots for e in book)
        return {
            "following_ledger": self.following,
            "routers_seen": self.routers_seen,
            "ledger_open": len(self.ledger.book.open) if caught_up else None,
            "ledger_kv_blocks": blocks if caught_up else None,
            "ledger_slots": slots if caught_up else None,
            "nodes_kv_blocks_used": sum(hb.kv_blocks_used for hb in live),
            "nodes_requests": sum(hb.running + hb.waiting for hb in live),
            "runs": self.runs,
            "rebuilds": self.rebuilds,
            "actions": dict(self.actions),
            "last_run_age_s": None if self.last_run_s is None else now - self.last_run_s,
        }
