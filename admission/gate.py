"""The admission edge inside a router: tenants by API key, budget from the load table,
reservations, the priority queue, the learned output estimate and ledger events. Decisions come
from the pure :mod:`admission.core` and :mod:`admission.queue`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import replace
from typing import Literal

from admission.core import (
    ONE_OUTPUT,
    Budget,
    OutputShape,
    Rejection,
    RejectReason,
    Verdict,
    admit,
    kv_blocks_for,
    priority_limit,
)
from admission.estimate import OutputEstimator
from admission.exceptions import AdmissionError
from admission.queue import AdmissionQueues, Waiting
from admission.reservations import (
    TENANT_LIMIT,
    InProcessReservations,
    Reservation,
    ReservationStore,
)
from admission.settings import AdmissionSettings, Priority, Tenant
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
            settings.retry_guard_client_burst,
        )
        self._publish = publish
        self.held: dict[str, Reservation] = {}  # what this router reserved and still holds
        self.queues = AdmissionQueues(settings)
        self._waiters: dict[Waiting, asyncio.Future[Verdict]] = {}
        self._node_blocks: dict[str, list[int]] = {}  # pool -> KV blocks per node, last seen
        self.estimator = OutputEstimator(
            quantile=settings.output_quantile, min_samples=settings.output_min_samples
        )
        self._pump_lock = asyncio.Lock()
        self._weights = {t.name: t.weight for t in settings.tenants.values()}
        self._weights[settings.anonymous.name] = settings.anonymous.weight
        self._demand: dict[str, float] = {}  # tenant -> when it last asked this router

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

    def limit(self, tenant: Tenant, total_blocks: int) -> int:
        """The most KV blocks reservations may hold once this tenant's request is in."""
        return int(priority_limit(tenant.priority, self.settings) * total_blocks)

    def slot_limit(self, priority: Priority, total_slots: int) -> int:
        """The most concurrent requests reservations may hold once this request is in."""
        return max(1, int(priority_limit(priority, self.settings) * total_slots))

    def _asked(self, tenant: Tenant, now: float) -> None:
        self._demand[tenant.name] = now
        if len(self._demand) > 4 * len(self._weights) + 64:
            window = self.settings.fair_share_window_s
            self._demand = {t: at for t, at in self._demand.items() if now - at <= window}

    async def tenant_limits(
        self, tenant: Tenant, pool: str, b: Budget, usage_after: float, now: float
    ) -> tuple[int | None, int | None, str]:
        """The most KV blocks and slots ``tenant`` may hold in ``pool`` with this request in
        (None: no limit of its own), and why: its hard caps (``max_kv_share``,
        ``max_concurrency``) and, once the pool is contended (above yellow), its weighted fair
        share among the tenants that hold reservations or asked this router within
        ``fair_share_window_s`` — only for a tenant already holding something, so every tenant
        can always run one request."""
        s = self.settings
        blocks = (
            int(tenant.max_kv_share * b.kv_blocks_total)
            if tenant.max_kv_share is not None
            else None
        )
        why = "max_kv_share"
        if s.fair_share and usage_after > s.yellow_watermark:
            usage = await self.store.tenant_usage(pool)
            if usage.get(tenant.name, (0, 0))[1] > 0:
                window = s.fair_share_window_s
                asking = {t for t, at in self._demand.items() if now - at <= window}
                active = {t for t, (_, slots) in usage.items() if slots > 0} | asking
                active.add(tenant.name)
                total = sum(self._weights.get(t, 1.0) for t in active)
                share = int(
                    self._weights.get(tenant.name, 1.0)
                    / total
                    * self.limit(tenant, b.kv_blocks_total)
                )
                if blocks is None or share < blocks:
                    blocks, why = share, f"fair share ({len(active)} tenants)"
        return blocks, tenant.max_concurrency, why

    def _quota_rejection(self, tenant: Tenant, why: str, kv_blocks: int, usage: float) -> Verdict:
        return Verdict(
            False,
            kv_blocks,
            usage,
            Rejection(
                RejectReason.TENANT_QUOTA,
                True,
                max(self.settings.min_retry_after_s, 1.0),
                f"tenant {tenant.name} is at its limit ({why}, max_concurrency "
                f"{tenant.max_concurrency})",
            ),
        )

    def observe_output(self, tenant: Tenant, model: str, output_tokens: int) -> None:
        """A finished request's actual output length (feeds the learned estimate)."""
        if self.settings.learn_output:
            self.estimator.observe(tenant.name, model, output_tokens)

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
        model: str = "",
        shape: OutputShape = ONE_OUTPUT,
        ttft_deadline_s: float | None = None,
    ) -> Verdict:
        """Admit (reserving), queue until admitted or refused, or refuse now (503 when the
        reservation store cannot answer: nothing is admitted that the budget cannot see).
        ``ttft_deadline_s``: its SLO class's TTFT, the longest it may wait in the queue."""
        self._asked(tenant, now)
        try:
            self._node_blocks[pool] = list(node_blocks)
            expected = (
                self.estimator.expected(
                    tenant.name, model, max_tokens, self.settings.expected_output_cap
                )
                if self.settings.learn_output
                else None
            )
            b = await self.budget(pool, node_blocks, now)
            verdict = admit(
                prompt_tokens,
                max_tokens,
                block_size,
                tenant.priority,
                b,
                self.settings,
                expected,
                shape,
            )
            verdict = replace(verdict, output_estimate=expected)
            if self.queues.waiting_at_or_above(pool, tenant.priority):
                verdict = self.queues.hold(verdict, tenant.priority, self.settings)
            if verdict.queue:
                return await self._wait(request_id, tenant, pool, verdict, b, now, ttft_deadline_s)
            if not verdict.admitted:
                return verdict
            # the snapshot may be stale (other routers): the store checks the limit atomically
            t_blocks, t_slots, why = await self.tenant_limits(
                tenant, pool, b, verdict.usage_after, now
            )
            r = await self.store.try_reserve(
                request_id,
                pool,
                verdict.kv_blocks,
                self.limit(tenant, b.kv_blocks_total),
                now,
                self.settings.lease_s,
                self.slot_limit(tenant.priority, b.slots_total),
                tenant.name,
                t_blocks,
                t_slots,
            )
            if r == TENANT_LIMIT:
                return self._quota_rejection(tenant, why, verdict.kv_blocks, verdict.usage_after)
            if not isinstance(r, Reservation):
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
            self.held[request_id] = r
            await self.record("reserve", r, now)
        except AdmissionError as exc:
            log.warning("admission refused %s: %s", request_id, exc)
            return Verdict(
                False,
                0,
                0.0,
                Rejection(RejectReason.STORE_UNAVAILABLE, True, 1.0, str(exc)),
            )
        return verdict

    async def screen_and_admit(
        self,
        request_id: str,
        tenant: Tenant,
        attempt: str,
        client: str,
        prompt_tokens: int,
        max_tokens: int,
        block_size: int,
        pool: str,
        node_blocks: Sequence[int],
        now: float,
        model: str = "",
        shape: OutputShape = ONE_OUTPUT,
        ttft_deadline_s: float | None = None,
    ) -> Verdict:
        """:meth:`early_retry` (a ``retry_storm`` refusal), then :meth:`admit`. The common case
        — nothing guarded, nobody queued, the pool below yellow with this request in — takes
        one round trip to the store (:meth:`_admit_below_yellow`); anything else the two steps
        in turn, as they answer alone."""
        verdict = await self._admit_below_yellow(
            request_id,
            tenant,
            attempt,
            client,
            prompt_tokens,
            max_tokens,
            block_size,
            pool,
            node_blocks,
            now,
            model,
            shape,
        )
        if verdict is not None:
            return verdict
        early = await self.early_retry(tenant, attempt, now, client)
        if early is not None:
            return Verdict(False, 0, 0.0, early)
        return await self.admit(
            request_id,
            tenant,
            prompt_tokens,
            max_tokens,
            block_size,
            pool,
            node_blocks,
            now,
            model,
            shape,
            ttft_deadline_s,
        )

    async def _admit_below_yellow(
        self,
        request_id: str,
        tenant: Tenant,
        attempt: str,
        client: str,
        prompt_tokens: int,
        max_tokens: int,
        block_size: int,
        pool: str,
        node_blocks: Sequence[int],
        now: float,
        model: str,
        shape: OutputShape,
    ) -> Verdict | None:
        """The verdict :func:`admission.core.admit` gives every priority below yellow,
        reserved against the yellow limits (so it holds only if the pool stays at or below
        yellow with it in: exactly then the core admits whatever the priority, and tenant caps
        are the tenant's own, no fair share) — or None: the full path decides (guarded, queued
        requests waiting, above yellow, too large, no capacity). The store checks the retry
        guard's keys in the same round trip when it can read them."""
        s = self.settings
        total_blocks = sum(node_blocks)
        yellow_blocks = int(s.yellow_watermark * total_blocks)
        slots_total = len(node_blocks) * s.slots_per_node
        yellow_slots = int(s.yellow_watermark * slots_total)
        if (
            yellow_blocks <= 0
            or yellow_slots <= 0
            or math.ceil(prompt_tokens / block_size) > max(node_blocks)
            or self.queues.waiting_at_or_above(pool, tenant.priority)
        ):
            return None
        guard: list[str] = []
        if s.retry_guard:
            attempts = self.storm.attempts(client, attempt, self._new_requests_guarded(tenant))
            keys = self.storm.store.keys(attempts)
            if keys is None:  # not where the store can read them: ask the guard (no strike)
                try:
                    ats = await self.storm.store.not_before_many(attempts)
                except AdmissionError:
                    return None
                if any(at is not None and now < at for at in ats):
                    return None
            else:
                guard = keys
        expected = (
            self.estimator.expected(tenant.name, model, max_tokens, s.expected_output_cap)
            if s.learn_output
            else None
        )
        blocks = kv_blocks_for(prompt_tokens, max_tokens, block_size, s, expected, shape)
        caps = int(tenant.max_kv_share * total_blocks) if tenant.max_kv_share is not None else None
        try:
            got = await self.store.reserve_unguarded(
                guard,
                request_id,
                pool,
                blocks,
                yellow_blocks,
                now,
                s.lease_s,
                yellow_slots,
                tenant.name,
                caps,
                tenant.max_concurrency,
            )
        except AdmissionError as exc:
            log.warning("admission refused %s: %s", request_id, exc)
            return Verdict(
                False, 0, 0.0, Rejection(RejectReason.STORE_UNAVAILABLE, True, 1.0, str(exc))
            )
        if not isinstance(got, tuple):
            return None  # guarded, over a tenant cap or not below yellow: the full path says
        r, held_blocks, held_slots = got
        usage = max(held_blocks / total_blocks, held_slots / slots_total)
        self._asked(tenant, now)  # as admit() notes it (a guarded request never gets here)
        self._node_blocks[pool] = list(node_blocks)
        self.held[request_id] = r
        await self.record("reserve", r, now)
        return Verdict(True, blocks, usage, output_estimate=expected)

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
        try:
            r = await self.store.try_reserve(
                key,
                pool,
                kv_blocks,
                sum(node_blocks),
                now,
                self.settings.lease_s,
                max(1, len(node_blocks) * self.settings.slots_per_node),
                tenant.name,
                None,
                None,
            )
        except AdmissionError as exc:
            log.warning("no prefill reservation for %s: %s", key, exc)
            return False
        if not isinstance(r, Reservation):
            return False
        self.held[key] = r
        await self.record("reserve", r, now)
        return True

    async def _wait(
        self,
        request_id: str,
        tenant: Tenant,
        pool: str,
        verdict: Verdict,
        b: Budget,
        now: float,
        ttft_deadline_s: float | None = None,
    ) -> Verdict:
        timeout = self.settings.queue_timeout_s.get(tenant.priority, 0.0)
        if ttft_deadline_s is not None:
            timeout = min(timeout, ttft_deadline_s)
        w = Waiting(
            request_id, pool, tenant.priority, verdict.kv_blocks, now, now + timeout, tenant
        )
        refused = self.queues.offer(w, b, now)
        if refused is not None:
            return replace(verdict, queue=False, rejection=refused)
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._waiters[w] = fut
        try:
            await self.pump(now)
            return await fut
        except asyncio.CancelledError:
            # admitted in the instant the client left: nobody will release it but us
            if fut.done() and not fut.cancelled() and fut.result().admitted:
                await self.release(request_id, now)
            raise
        finally:
            if fut.cancelled() or not fut.done():  # the client went away while queued
                self.queues.remove(w)
            self._waiters.pop(w, None)

    async def pump(self, now: float) -> int:
        """Admit what the queues may let in now; refuse what waited past its deadline."""
        admitted = 0
        async with self._pump_lock:
            for gone in self.queues.expired(now):
                fut = self._waiters.get(gone)
                if fut is not None and not fut.done():
                    fut.set_result(
                        Verdict(
                            False,
                            gone.kv_blocks,
                            1.0,
                            Rejection(
                                RejectReason.QUEUE_TIMEOUT,
                                True,
                                self.settings.min_retry_after_s,
                                f"waited {now - gone.enqueued_at:.1f} s "
                                f"in the {gone.priority} queue",
                            ),
                            queue_wait_s=now - gone.enqueued_at,
                        )
                    )
            for pool in self.queues.pools():
                b = await self.budget(pool, self._node_blocks.get(pool, []), now)
                while (head := self.queues.admissible(pool, b)) is not None:
                    limit = int(priority_limit(head.priority, self.settings) * b.kv_blocks_total)
                    t = head.tenant or self.settings.anonymous
                    t_blocks, t_slots, why = await self.tenant_limits(t, pool, b, 1.0, now)
                    r = await self.store.try_reserve(
                        head.request_id,
                        pool,
                        head.kv_blocks,
                        limit,
                        now,
                        self.settings.lease_s,
                        self.slot_limit(head.priority, b.slots_total),
                        t.name,
                        t_blocks,
                        t_slots,
                    )
                    if r == TENANT_LIMIT:  # over its share: refused, the queue moves on
                        self.queues.remove(head)
                        fut = self._waiters.get(head)
                        if fut is not None and not fut.done():
                            fut.set_result(
                                self._quota_rejection(t, why, head.kv_blocks, b.usage_after(0))
                            )
                        continue
                    if not isinstance(r, Reservation):  # another router took the room first
                        break
                    self.queues.remove(head)
                    self.held[head.request_id] = r
                    await self.record("reserve", r, now)
                    admitted += 1
                    b = replace(b, kv_blocks_reserved=b.kv_blocks_reserved + r.kv_blocks)
                    fut = self._waiters.get(head)
                    if fut is not None and not fut.done():
                        fut.set_result(
                            Verdict(
                                True,
                                head.kv_blocks,
                                b.usage_after(0),
                                queue_wait_s=now - head.enqueued_at,
                            )
                        )
                    elif fut is None or fut.cancelled():  # nobody waits for it any more
                        await self.release(head.request_id, now)
        return admitted

    async def run_pump(self, clock: Callable[[], float]) -> None:
        """Re-check the queues every ``queue_poll_s`` (other routers release room too)."""
        while True:
            await asyncio.sleep(self.settings.queue_poll_s)
            if len(self.queues):
                with contextlib.suppress(Exception):
                    await self.pump(clock())

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
        """Give the reservation back. Never raises: when the store cannot answer, the release
        is still recorded on the ledger (the reconciler then drops it from the store)."""
        mine = self.held.pop(request_id, None)
        try:
            r = await self.store.release(request_id, now)
        except AdmissionError as exc:
            log.warning("release of %s not applied to the store: %s", request_id, exc)
            if mine is not None:
                await self.record("release", mine, now, "the store was unreachable")
            return
        if r is None and mine is not None:  # the store lost it (expired, or reset)
            r = mine
        if r is not None:
            await self.record("release", r, now)
            if len(self.queues) and not self._pump_lock.locked():
                with contextlib.suppress(AdmissionError):
                    await self.pump(now)

    async def sweep(self, now: float) -> int:
        """Expire reservations whose lease ran out, with a compensation event each."""
        dead = await self.store.expire(now)
        for r in dead:
            self.held.pop(r.reservation_id, None)
            log.warning("reservation %s expired (lease ran out)", r.reservation_id)
            await self.record("expire", r, now, "lease ran out")
        return len(dead)

    async def renew(self, request_ids: Iterable[str], now: float, force: bool = False) -> int:
        """Move the leases of requests this router is still serving, once less than
        ``lease_renew_at`` of the lease is left (``force``: now), with a ``renew`` ledger event
        each. Returns how many were renewed; raises :class:`AdmissionError` when the store
        cannot answer (the router's next sweep tries again)."""
        s = self.settings
        renewed = 0
        for rid in request_ids:
            r = self.held.get(rid)
            if r is None or (not force and r.expires_at - now > s.lease_s * s.lease_renew_at):
                continue
            got = await self.store.renew(rid, now + s.lease_s)  # AdmissionError: store down
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
        self,
        kind: Literal["reserve", "release", "expire", "renew"],
        r: Reservation,
        now: float,
        cause: str | None = None,
    ) -> None:
        """A ledger event (also written by the reconciler, on a dead router's behalf)."""
        await self._publish(
            LedgerEvent(
                schema_version=2 if kind == "renew" else 1,
                reservation_id=r.reservation_id,
                pool=r.pool,
                kind=kind,
                kv_blocks=r.kv_blocks,
                slots=r.slots,
                tenant=r.tenant or None,
                router_id=self.router_id,
                ts=now,
                lease_expires_at=r.expires_at if kind in ("reserve", "renew") else None,
                cause=cause,
            )
        )
