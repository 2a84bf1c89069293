"""What a router reserved and still holds, and the ledger events that say so: a reservation
made (``reserve``), given back (``release``), run out of lease (``expire``) or its lease moved
(``renew``). The KV ledger is built from these events (streams/ledger.py), and the reconciler
writes them on a dead router's behalf (admission/reconciler.py).

A router's own events are rendered from their fields without a second validation
(streams/trusted.py) when it is given ``publish_json``; else each is a :class:`LedgerEvent`
handed to ``publish``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

from admission.exceptions import AdmissionError
from admission.reservations import Reservation, ReservationStore
from streams.schemas import LedgerEvent
from streams.trusted import Shape, record_json

__all__ = ["LEDGER_EVENT", "Holdings", "Publish", "PublishJson"]

log = logging.getLogger(__name__)

Publish = Callable[[LedgerEvent], Awaitable[None]]
PublishJson = Callable[[str, bytes], object]  # (the event's pool: its key, the event rendered)
LEDGER_EVENT = Shape(LedgerEvent)
Kind = Literal["reserve", "release", "expire", "renew"]


class Holdings:
    """This router's reservations in ``store``, each change told to the ledger."""

    def __init__(
        self,
        store: ReservationStore,
        router_id: str,
        publish: Publish,
        publish_json: PublishJson | None = None,
    ) -> None:
        self.store = store
        self.router_id = router_id
        self._publish = publish
        self._publish_json = publish_json
        self.held: dict[str, Reservation] = {}

    async def hold(self, r: Reservation, now: float) -> None:
        self.held[r.reservation_id] = r
        await self.record("reserve", r, now)

    async def give_back(self, request_id: str, now: float) -> bool:
        """Release ``request_id``'s reservation in the store. Never raises: when the store
        cannot answer, the release is still recorded on the ledger (the reconciler then drops
        it from the store). Whether a reservation was given back."""
        mine = self.held.pop(request_id, None)
        try:
            r = await self.store.release(request_id, now)
        except AdmissionError as exc:
            log.warning("release of %s not applied to the store: %s", request_id, exc)
            if mine is not None:
                await self.record("release", mine, now, "the store was unreachable")
            return False
        if r is None and mine is not None:  # the store lost it (expired, or reset)
            r = mine
        if r is None:
            return False
        await self.record("release", r, now)
        return True

    async def sweep(self, now: float) -> int:
        """Expire reservations whose lease ran out, with a compensation event each."""
        dead = await self.store.expire(now)
        for r in dead:
            self.held.pop(r.reservation_id, None)
            log.warning("reservation %s expired (lease ran out)", r.reservation_id)
            await self.record("expire", r, now, "lease ran out")
        return len(dead)

    async def renew(
        self, request_ids: Iterable[str], now: float, lease_s: float, due_s: float | None
    ) -> int:
        """Move the leases of ``request_ids`` that have less than ``due_s`` left (None: all)
        to ``now + lease_s``, with a ``renew`` event each; how many were renewed. Raises
        :class:`AdmissionError` when the store cannot answer."""
        renewed = 0
        for rid in request_ids:
            r = self.held.get(rid)
            if r is None or (due_s is not None and r.expires_at - now > due_s):
                continue
            got = await self.store.renew(rid, now + lease_s)  # AdmissionError: store down
            if got is None:  # expired by another router, or the store lost it (restored later)
                log.warning("reservation %s is not in the store; lease not renewed", rid)
                continue
            if rid not in self.held:  # released while the store renewed it: stays released
                continue
            self.held[rid] = got
            await self.record("renew", got, now)
            renewed += 1
        return renewed

    async def record(
        self, kind: Kind, r: Reservation, now: float, cause: str | None = None
    ) -> None:
        """A ledger event of this router's."""
        fields: dict[str, Any] = {
            "schema_version": 2 if kind == "renew" else 1,
            "reservation_id": r.reservation_id,
            "pool": r.pool,
            "kind": kind,
            "kv_blocks": r.kv_blocks,
            "slots": r.slots,
            "tenant": r.tenant or None,
            "router_id": self.router_id,
            "ts": now,
            "lease_expires_at": r.expires_at if kind in ("reserve", "renew") else None,
            "cause": cause,
        }
        if self._publish_json is not None:
            self._publish_json(r.pool, record_json(LEDGER_EVENT, fields))
        else:
            await self._publish(LedgerEvent.model_validate(fields))
