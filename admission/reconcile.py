"""The reconciler's decisions: compare the KV ledger, the reservation store and the nodes' own
report, and say what to fix. Pure; :mod:`admission.reconciler` does the I/O.

The ledger (``kvgate.ledger`` folded into :class:`streams.ledger.LedgerBook`) is the record of
which reservations are open; the store is what admission checks against. A router writes the
store first and the ledger event right after, so for a moment the two legitimately differ; every
rule below waits ``grace_s`` before acting on a difference that could be such a moment.

Rules (seen → meaning → fix):

* open in the ledger and in the store → consistent.
* open in the ledger, not in the store, lease over → its release or expire event was lost →
  ``expire`` event.
* open in the ledger, not in the store, the store was reset → the store lost its data (Redis
  restarted empty) → restore it into the store.
* open in the ledger, not in the store for ``grace_s`` → a release whose event was lost →
  ``expire`` event.
* open in the ledger, not in the store, sole owner and not ours → the router that held it is
  gone (in-process store: there is only one router) → ``expire`` event.
* in the store, closed in the ledger → released while the store was unreachable, or restored
  as it closed → drop from the store.
* in the store, never in the ledger, older than ``grace_s`` → its reserve event was lost →
  ``reserve`` event (the ledger adopts it).
* in the store while its pool's nodes all reported idle for ``grace_s`` → nothing runs for it
  → drop + ``expire`` event.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from admission.reservations import Reservation
from streams.schemas import LedgerEvent

__all__ = ["ReconcilePlan", "plan_reconcile"]


@dataclass(slots=True)
class ReconcilePlan:
    restore: list[LedgerEvent] = field(default_factory=list)
    compensate: list[tuple[LedgerEvent, str]] = field(default_factory=list)  # (entry, cause)
    adopt: list[Reservation] = field(default_factory=list)
    drop: list[Reservation] = field(default_factory=list)
    orphans: list[Reservation] = field(default_factory=list)
    suspects: dict[str, float] = field(default_factory=dict)  # ledger-only id -> first seen

    def __len__(self) -> int:
        return (
            len(self.restore)
            + len(self.compensate)
            + len(self.adopt)
            + len(self.drop)
            + len(self.orphans)
        )

    def counts(self) -> dict[str, int]:
        return {
            "restore": len(self.restore),
            "compensate": len(self.compensate),
            "adopt": len(self.adopt),
            "drop": len(self.drop),
            "orphan": len(self.orphans),
        }


def plan_reconcile(
    ledger_open: Mapping[str, LedgerEvent],
    ledger_closed: Collection[str],
    store: Mapping[str, Reservation],
    now: float,
    *,
    lease_s: float,
    grace_s: float,
    store_reset: bool,
    suspects: Mapping[str, float],
    sole_owner: str | None = None,
    own: Collection[str] = (),
    idle_since: Mapping[str, float] | None = None,
) -> ReconcilePlan:
    """What to fix. ``suspects`` is the previous plan's (ledger-only entries and when first
    seen); ``sole_owner`` the router id when the store is this router's alone and ``own`` its
    reservations; ``idle_since[pool]`` since when every live node of the pool reports nothing
    running or waiting."""
    plan = ReconcilePlan()
    for rid, entry in ledger_open.items():
        if rid in store:
            continue
        expires = entry.lease_expires_at
        if expires is None:
            expires = entry.ts + lease_s
        if expires <= now:
            # the store's sweep (any router's) records each expiry it makes: that event has the
            # grace to reach the ledger before the reconciler records one more (a store that
            # came back empty swept nothing)
            if store_reset or now - expires >= grace_s:
                plan.compensate.append((entry, "lease ran out; its close was never recorded"))
        elif sole_owner is not None and rid not in own and now - entry.ts >= grace_s:
            plan.compensate.append((entry, f"not held by {sole_owner}, the only router"))
        elif store_reset:
            plan.restore.append(entry)
        else:
            first = suspects.get(rid, now)
            if now - first >= grace_s:
                plan.compensate.append((entry, "released, but its release was never recorded"))
            else:
                plan.suspects[rid] = first
    idle = idle_since or {}
    for rid, r in store.items():
        made = r.expires_at - lease_s
        if rid in ledger_open:
            since = idle.get(r.pool)
            if since is not None and now - max(since, made) >= grace_s:
                plan.orphans.append(r)
            continue
        if rid in ledger_closed:
            plan.drop.append(r)
        elif now - made >= grace_s:
            plan.adopt.append(r)
    return plan
