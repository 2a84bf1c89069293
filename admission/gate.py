"""The admission edge inside a router: tenants by API key, budget from the load table,
reservations, and ledger events. Decisions come from the pure :mod:`admission.core`."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence

from admission.core import Budget, Rejection, RejectReason, Verdict, admit
from admission.reservations import InProcessReservations, ReservationStore
from admission.settings import AdmissionSettings, Tenant
from admission.storm import InProcessStormStore, StormGuard, StormStore
from streams.schemas import LedgerEvent

__all__ = ["AdmissionGate"]

log = logging.getLogger(__name__)
Publish = Callable[[LedgerEvent], Awaitable[None]]


class AdmissionGate:
    def __init__(
        self,
        settings: AdmissionSettings,
        router_id: str,
        publish: Publish,
        store: ReservationStore | None = None,
        storm_store: StormStore | None = None,
    ) -> None:
        self.settings = settings
        self.router_id = router_id
        self.store: ReservationStore = store if store is not None else InProcessReservations()
        self.storm = StormGuard(
            storm_store if storm_store is not None else InProcessStormStore(),
            settings.retry_guard_window_s,
            settings.retry_guard_max_s,
        )
        self._publish = publish
        self._pools: dict[str, str] = {}  # reservation id -> pool

    def tenant(self, authorization: str | None) -> Tenant | Rejection:
        """The tenant of an ``Authorization: Bearer <key>`` header (keys compared in constant
        time); anonymous when no key is required and none is given."""
        key = None
        if authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        if key:
            for known, tenant in self.settings.tenants.items():
                if hmac.compare_digest(known.encode(), key.encode()):
                    return tenant
            return Rejection(RejectReason.UNAUTHORIZED, False, None, "unknown API key")
        if self.settings.require_api_key:
            return Rejection(RejectReason.UNAUTHORIZED, False, None, "an API key is required")
        return self.settings.anonymous

    async def budget(self, pool: str, node_blocks: Sequence[int], now: float) -> Budget:
        held_blocks, held_slots, drain = await self.store.snapshot(pool, now)
        return Budget(
            kv_blocks_total=sum(node_blocks),
            slots_total=len(node_blocks) * self.settings.slots_per_node,
            kv_blocks_reserved=held_blocks,
            slots_reserved=held_slots,
            largest_node_blocks=max(node_blocks, default=0),
            drain_blocks_per_s=drain,
        )

    def limit(self, tenant: Tenant, total_blocks: int) -> int:
        """The most KV blocks reservations may hold once this tenant's request is in."""
        share = {
            "low": self.settings.yellow_watermark,
            "normal": self.settings.red_watermark,
            "high": 1.0,
        }[tenant.priority]
        return int(share * total_blocks)

    async def admit(
        self,
        request_id: str,
        tenant: Tenant,
        prompt_tokens: int,
        max_tokens: int,
        block_size: int,
        pool: str,
        node_blocks: Sequence[int],
        now: float,
    ) -> Verdict:
        b = await self.budget(pool, node_blocks, now)
        verdict = admit(prompt_tokens, max_tokens, block_size, tenant.priority, b, self.settings)
        if not verdict.admitted:
            return verdict
        # the snapshot may be stale (other routers): the store checks the limit atomically
        r = await self.store.try_reserve(
            request_id,
            pool,
            verdict.kv_blocks,
            self.limit(tenant, b.kv_blocks_total),
            now,
            self.settings.lease_s,
        )
        if r is None:
            retry = max(self.settings.min_retry_after_s, 1.0)
            return Verdict(
                False,
                verdict.kv_blocks,
                verdict.usage_after,
                Rejection(
                    RejectReason.RED_WATERMARK,
                    True,
                    retry,
                    "the cluster KV budget filled up concurrently",
                ),
            )
        self._pools[request_id] = pool
        await self._event("reserve", request_id, pool, r.kv_blocks, now, r.expires_at)
        return verdict

    async def early_retry(self, tenant: Tenant, attempt: str, now: float) -> Rejection | None:
        """A refusal when this attempt was refused before and came back too early."""
        if not self.settings.retry_guard:
            return None
        return await self.storm.check(tenant.name, attempt, now)

    async def refused(self, attempt: str, rejection: Rejection, now: float) -> None:
        if self.settings.retry_guard:
            await self.storm.refused(attempt, rejection, now)

    async def release(self, request_id: str, now: float) -> None:
        r = await self.store.release(request_id, now)
        self._pools.pop(request_id, None)
        if r is not None:
            await self._event("release", request_id, r.pool, r.kv_blocks, now, None)

    async def sweep(self, now: float) -> int:
        """Expire reservations whose lease ran out, with a compensation event each."""
        dead = await self.store.expire(now)
        for r in dead:
            self._pools.pop(r.reservation_id, None)
            log.warning("reservation %s expired (lease ran out)", r.reservation_id)
            await self._event("expire", r.reservation_id, r.pool, r.kv_blocks, now, None)
        return len(dead)

    async def _event(
        self, kind: str, rid: str, pool: str, blocks: int, now: float, expires: float | None
    ) -> None:
        await self._publish(
            LedgerEvent(
                reservation_id=rid,
                pool=pool,
                kind=kind,
                kv_blocks=blocks,
                router_id=self.router_id,
                ts=now,
                lease_expires_at=expires,
            )
        )
