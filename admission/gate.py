"""The admission edge inside a router: tenants by API key, budget from the load table,
reservations, the priority queue, the learned output estimate and ledger events. Decisions come
from the pure :mod:`admission.core` and :mod:`admission.queue`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Literal

from admission.core import (
    Budget,
    Rejection,
    RejectReason,
    Verdict,
    admit,
)
from admission.estimate import OutputEstimator
from admission.exceptions import AdmissionError
from admission.holdings import Holdings, Publish, PublishJson
from admission.plan import (
    AdmissionAsk,
    below_yellow,
    contended,
    filled_up,
    quota_refusal,
    reserve_ask,
    store_down,
    tenant_caps,
)
from admission.preempt import Preemptible
from admission.queue import AdmissionQueues
from admission.rates import InProcessRates, RateStore, TenantRates, counted
from admission.reservations import (
    TENANT_LIMIT,
    InProcessReservations,
    Reservation,
    ReservationStore,
    ReserveAsk,
)
from admission.settings import AdmissionSettings, Tenant
from admission.storm import InProcessStormStore, StormGuard, StormStore
from admission.waiting import Waiters

__all__ = ["AdmissionGate"]

log = logging.getLogger(__name__)


class AdmissionGate:
    def __init__(
        self,
        settings: AdmissionSettings,
        router_id: str,
        publish: Publish,
        store: ReservationStore | None = None,
        storm_store: StormStore | None = None,
        rates: RateStore | None = None,
        publish_json: PublishJson | None = None,
    ) -> None:
        self.settings = settings
        self.rates = TenantRates(rates if rates is not None else InProcessRates(), settings)
        self.router_id = router_id
        self.store: ReservationStore = store if store is not None else InProcessReservations()
        self.storm = StormGuard(
            storm_store if storm_store is not None else InProcessStormStore(),
            settings.retry_guard_window_s,
            settings.retry_guard_max_s,
            settings.retry_guard_client_burst,
        )
        # what this router reserved and still holds, told to the ledger (admission/holdings.py)
        self.holdings = Holdings(self.store, router_id, publish, publish_json)
        self.held = self.holdings.held
        self.queues = AdmissionQueues(settings)
        self.node_blocks: dict[str, list[int]] = {}  # pool -> KV blocks per node, last seen
        # pool -> KV blocks per node now (the router's views), for the queue's pump: a node that
        # joins or leaves changes what queued requests may take before another request arrives
        self.capacity: Callable[[float], Mapping[str, list[int]]] | None = None
        self.estimator = OutputEstimator(
            quantile=settings.output_quantile, min_samples=settings.output_min_samples
        )
        self.waiting = Waiters(self)  # the queue's waiters and its pump
        self.preemptible: Preemptible | None = None  # who can end sheddable work (preempt.py)
        self._weights = {t.name: t.weight for t in settings.tenants.values()}
        self._weights[settings.anonymous.name] = settings.anonymous.weight
        self._demand: dict[str, float] = {}  # tenant -> when it last asked this router
        self._hungry: dict[str, float] = {}  # tenant -> when it was last refused or queued

    def tenant(self, key: str | None) -> Tenant | Rejection:
        """The tenant of an API key (the edge takes it from ``Authorization: Bearer <key>``;
        compared in constant time against every known key); anonymous when no key is required
        and none is given."""
        if key:
            found = None
            for known, tenant in self.settings.tenants.items():
                if hmac.compare_digest(known.encode(), key.encode()):
                    found = tenant
            if found is not None:
                return found
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

    def _asked(self, tenant: Tenant, now: float) -> None:
        self._demand[tenant.name] = now
        if len(self._demand) > 4 * len(self._weights) + 64:
            window = self.settings.fair_share_window_s
            self._demand = {t: at for t, at in self._demand.items() if now - at <= window}

    def wanting(self, tenant: Tenant, now: float) -> None:
        """``tenant`` was refused or queued: it wants more than it holds (its fair share
        counts it as hungry for ``fair_share_window_s``)."""
        self._hungry[tenant.name] = now
        if len(self._hungry) > 4 * len(self._weights) + 64:
            window = self.settings.fair_share_window_s
            self._hungry = {t: at for t, at in self._hungry.items() if now - at <= window}

    async def tenant_limits(
        self, tenant: Tenant, pool: str, b: Budget, usage_after: float, now: float
    ) -> tuple[int | None, int | None, str]:
        """:func:`admission.plan.tenant_caps` in ``pool``, with the tenants' usage read from
        the store when the pool is contended (their fair share then counts the tenants that
        asked this router within ``fair_share_window_s``)."""
        s = self.settings
        usage = await self.store.tenant_usage(pool) if contended(s, usage_after) else None
        window = s.fair_share_window_s
        asking = {t for t, at in self._demand.items() if now - at <= window}
        hungry = {t for t, at in self._hungry.items() if now - at <= window}
        return tenant_caps(tenant, b, usage, asking, self._weights, s, hungry)

    def _expected(self, ask: AdmissionAsk) -> int | None:
        """The output tokens to reserve KV for, learned per tenant and model (None: not
        learned, reserve for ``max_tokens``)."""
        s = self.settings
        if not s.learn_output:
            return None
        return self.estimator.expected(
            ask.tenant.name, ask.model, ask.max_tokens, s.expected_output_cap
        )

    async def hold(self, r: Reservation, now: float) -> None:
        await self.holdings.hold(r, now)

    def observe_output(self, tenant: Tenant, model: str, output_tokens: int) -> None:
        """A finished request's actual output length (feeds the learned estimate)."""
        if self.settings.learn_output:
            self.estimator.observe(tenant.name, model, output_tokens)

    async def admit(self, ask: AdmissionAsk, now: float) -> Verdict:
        """Admit (reserving), queue until admitted or refused, or refuse now (503 when the
        reservation store cannot answer: nothing is admitted that the budget cannot see)."""
        tenant, pool, s = ask.tenant, ask.pool, self.settings
        self._asked(tenant, now)
        try:
            self.node_blocks[pool] = list(ask.node_blocks)
            expected = self._expected(ask)
            b = await self.budget(pool, ask.node_blocks, now)
            verdict = admit(
                ask.prompt_tokens,
                ask.max_tokens,
                ask.block_size,
                tenant.priority,
                b,
                s,
                expected,
                ask.shape,
            )
            verdict = replace(verdict, output_estimate=expected)
            if self.queues.waiting_at_or_above(pool, tenant.priority, now):
                verdict = self.queues.hold(verdict, tenant.priority, s)
            if verdict.queue:
                self.wanting(tenant, now)
                return await self.waiting.wait(ask, verdict, b, now)
            if not verdict.admitted:
                self.wanting(tenant, now)
                return verdict
            # the snapshot may be stale (other routers): the store checks the limit atomically
            t_blocks, t_slots, why = await self.tenant_limits(
                tenant, pool, b, verdict.usage_after, now
            )
            plan = reserve_ask(
                ask.request_id,
                tenant.name,
                tenant.priority,
                pool,
                verdict.kv_blocks,
                b,
                s,
                t_blocks,
                t_slots,
            )
            r = await self.store.try_reserve(plan, now)
            if not isinstance(r, Reservation):
                self.wanting(tenant, now)
            if r == TENANT_LIMIT:
                return quota_refusal(tenant, why, verdict.kv_blocks, verdict.usage_after, s)
            if not isinstance(r, Reservation):
                return filled_up(verdict, s)
            await self.hold(r, now)
        except AdmissionError as exc:
            log.warning("admission refused %s: %s", ask.request_id, exc)
            return store_down(str(exc))
        return replace(verdict, local_share=r.local)

    async def screen_and_admit(self, ask: AdmissionAsk, now: float) -> Verdict:
        """:meth:`_screen_and_admit`, counted against the tenant's rates when it has any (and
        given back when it is refused or its caller leaves)."""
        t = ask.tenant
        if not counted(t):
            return await self._screen_and_admit(ask, now)
        over = await self.rates.count(ask, now)
        if over is not None:
            return over
        try:
            verdict = await self._screen_and_admit(ask, now)
        except asyncio.CancelledError:
            await asyncio.shield(self.rates.uncount(t, ask.request_id))
            raise
        if not verdict.admitted:
            await self.rates.uncount(t, ask.request_id)
        return verdict

    async def _screen_and_admit(self, ask: AdmissionAsk, now: float) -> Verdict:
        """:meth:`early_retry` (a ``retry_storm`` refusal), then :meth:`admit`. The common case
        — nothing guarded, nobody queued, the pool below yellow with this request in — takes
        one round trip to the store (:meth:`_admit_below_yellow`); anything else the two steps
        in turn, as they answer alone.

        Cancelled on the way (the caller went away: an ext_proc stream Envoy reset), whatever
        the store made for the request — a reservation whose answer never came back — is
        released then and there, never left to its lease."""
        try:
            verdict = await self._admit_below_yellow(ask, now)
            if verdict is not None:
                return verdict
            early = await self.early_retry(ask.tenant, ask.attempt, now, ask.client)
            if early is not None:
                return Verdict(False, 0, 0.0, early)
            return await self.admit(ask, now)
        except asyncio.CancelledError:
            await asyncio.shield(self.release(ask.request_id, time.time()))
            raise

    async def _guard_keys(self, ask: AdmissionAsk, now: float) -> list[str] | None:
        """The retry guard's keys for the store to check in the reservation's round trip
        (empty: the guard is off); None when the guard holds the attempt back, or it cannot
        be asked — the full path decides then."""
        if not self.settings.retry_guard:
            return []
        attempts = self.storm.attempts(
            ask.client, ask.attempt, self._new_requests_guarded(ask.tenant)
        )
        keys = self.storm.store.keys(attempts)
        if keys is not None:
            return keys
        try:  # not where the store can read them: ask the guard (no strike)
            ats = await self.storm.store.not_before_many(attempts)
        except AdmissionError:
            return None
        return None if any(at is not None and now < at for at in ats) else []

    async def _admit_below_yellow(self, ask: AdmissionAsk, now: float) -> Verdict | None:
        """Reserve :func:`admission.plan.below_yellow`'s plan in one round trip (the store
        checks the retry guard's keys in it when it can read them) — or None: the full path
        decides (guarded, queued requests waiting, above yellow, too large, no capacity)."""
        s = self.settings
        expected = self._expected(ask)
        queued = self.queues.waiting_at_or_above(ask.pool, ask.tenant.priority, now)
        plan = below_yellow(ask, s, queued, expected)
        if plan is None:
            return None
        guard = await self._guard_keys(ask, now)
        if guard is None:
            return None
        try:
            got = await self.store.reserve_unguarded(plan, now, guard)
        except AdmissionError as exc:
            log.warning("admission refused %s: %s", ask.request_id, exc)
            return store_down(str(exc))
        if not isinstance(got, tuple):
            return None  # guarded, over a tenant cap or not below yellow: the full path says
        r, held_blocks, held_slots = got
        slots_total = len(ask.node_blocks) * s.slots_per_node
        usage = max(held_blocks / sum(ask.node_blocks), held_slots / slots_total)
        self._asked(ask.tenant, now)  # as admit() notes it (a guarded request never gets here)
        self.node_blocks[ask.pool] = list(ask.node_blocks)
        await self.hold(r, now)
        return Verdict(True, plan.kv_blocks, usage, output_estimate=expected, local_share=r.local)

    async def hold_extra(
        self,
        key: str,
        tenant: Tenant,
        pool: str,
        kv_blocks: int,
        node_blocks: Sequence[int],
        now: float,
    ) -> bool:
        """A second reservation for a request already admitted (its prompt's KV on a prefill
        node while it is computed and sent), up to the whole budget; False when it does not
        fit or the store cannot answer (the request then goes without it)."""
        slots = max(1, len(node_blocks) * self.settings.slots_per_node)
        plan = ReserveAsk(
            key, pool, kv_blocks, sum(node_blocks), self.settings.lease_s, slots, tenant.name
        )
        try:
            r = await self.store.try_reserve(plan, now)
        except AdmissionError as exc:
            log.warning("no prefill reservation for %s: %s", key, exc)
            return False
        if not isinstance(r, Reservation):
            return False
        await self.hold(r, now)
        return True

    async def pump(self, now: float) -> int:
        """Admit what the queues may let in now (admission/waiting.py)."""
        return await self.waiting.pump(now)

    async def run_pump(self, clock: Callable[[], float]) -> None:
        await self.waiting.run(clock)

    async def early_retry(
        self, tenant: Tenant, attempt: str, now: float, client: str | None = None
    ) -> Rejection | None:
        """A refusal when this attempt was refused before and came back too early, or when its
        client (default: the tenant) keeps sending new requests during its Retry-After."""
        if not self.settings.retry_guard:
            return None
        try:
            early = await self.storm.check_request(
                client or tenant.name, attempt, now, self._new_requests_guarded(tenant)
            )
        except AdmissionError as exc:  # the guard protects; it never takes the service down
            log.warning("retry guard skipped: %s", exc)
            return None
        return early

    def _new_requests_guarded(self, tenant: Tenant) -> bool:
        """Whether this tenant's new requests during its Retry-After count as a storm."""
        mode = self.settings.retry_guard_new_requests
        return mode == "all" or (
            mode == "anonymous" and tenant.name == self.settings.anonymous.name
        )

    async def refused(
        self,
        attempt: str,
        rejection: Rejection,
        now: float,
        client: str | None = None,
        tenant: Tenant | None = None,
    ) -> None:
        if self.settings.retry_guard:
            if tenant is not None and not self._new_requests_guarded(tenant):
                client = None  # its new requests are not held to the Retry-After
            try:
                await self.storm.refused(attempt, rejection, now, client)
            except AdmissionError as exc:
                log.warning("retry guard not told of a refusal: %s", exc)

    async def release(self, request_id: str, now: float) -> None:
        """Give the reservation back (never raises: admission/holdings.py), then let in what
        the queue may admit now."""
        if await self.holdings.give_back(request_id, now):
            if len(self.queues) and not self.waiting.lock.locked():
                with contextlib.suppress(AdmissionError):
                    await self.pump(now)

    async def sweep(self, now: float) -> int:
        """Expire reservations whose lease ran out, with a compensation event each."""
        return await self.holdings.sweep(now)

    async def renew(self, request_ids: Iterable[str], now: float, force: bool = False) -> int:
        """Move the leases of requests this router is still serving, once less than
        ``lease_renew_at`` of the lease is left (``force``: now), with a ``renew`` ledger event
        each. Returns how many were renewed; raises :class:`AdmissionError` when the store
        cannot answer (the router's next sweep tries again)."""
        s = self.settings
        due = None if force else s.lease_s * s.lease_renew_at
        return await self.holdings.renew(request_ids, now, s.lease_s, due)

    async def record(
        self,
        kind: Literal["reserve", "release", "expire", "renew"],
        r: Reservation,
        now: float,
        cause: str | None = None,
    ) -> None:
        """A ledger event (also written by the reconciler, on a dead router's behalf)."""
        await self.holdings.record(kind, r, now, cause)
