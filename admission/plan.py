"""Admission's plans, pure: what a request asks (:class:`AdmissionAsk`), what to reserve for it
(:class:`~admission.reservations.ReserveAsk`) and the limits that go with it — the priority's
watermark, the tenant's caps and weighted fair share, the one-round-trip path below yellow —
and the refusals the gate answers with. :mod:`admission.gate` asks the store for what these
need (a budget snapshot, the tenants' usage), runs them, and executes the result: nothing
here awaits or keeps state."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from admission.core import (
    ONE_OUTPUT,
    Budget,
    OutputShape,
    Rejection,
    RejectReason,
    Verdict,
    kv_blocks_for,
    priority_limit,
)
from admission.reservations import ReserveAsk
from admission.settings import AdmissionSettings, Priority, Tenant

__all__ = [
    "AdmissionAsk",
    "below_yellow",
    "contended",
    "filled_up",
    "quota_refusal",
    "reserve_ask",
    "store_down",
    "tenant_caps",
    "water_fill",
]


@dataclass(frozen=True, slots=True)
class AdmissionAsk:
    """One request at the admission gate."""

    request_id: str  # minted by kvgate: the reservation's id
    tenant: Tenant
    prompt_tokens: int
    max_tokens: int
    block_size: int
    pool: str  # the budget it is admitted against
    node_blocks: Sequence[int]  # the KV blocks of each node of that budget
    model: str = ""
    shape: OutputShape = ONE_OUTPUT
    ttft_deadline_s: float | None = None  # its SLO class's TTFT: the longest it may queue
    attempt: str = ""  # the attempt's identity (retries of one attempt share it)
    client: str = ""  # who retries (the retry guard's per-client limit)
    resuming: bool = False  # an agent session's next turn while its KV is held (queue order)


def reserve_ask(
    rid: str,
    tenant: str,
    priority: Priority,
    pool: str,
    kv_blocks: int,
    b: Budget,
    s: AdmissionSettings,
    tenant_blocks: int | None = None,
    tenant_slots: int | None = None,
) -> ReserveAsk:
    """Reserve ``kv_blocks`` in ``pool`` up to the watermark ``priority`` may reach (in blocks
    and in slots) and the tenant's own limits."""
    share = priority_limit(priority, s)
    return ReserveAsk(
        rid,
        pool,
        kv_blocks,
        int(share * b.kv_blocks_total),
        s.lease_s,
        max(1, int(share * b.slots_total)),
        tenant,
        tenant_blocks,
        tenant_slots,
    )


def contended(s: AdmissionSettings, usage_after: float) -> bool:
    """Whether tenants share the pool by weight now (fair share on, the pool above yellow with
    the request in): then the tenants' usage decides."""
    return s.fair_share and usage_after > s.yellow_watermark


def water_fill(
    capacity: float, demand: Mapping[str, float], weights: Mapping[str, float]
) -> dict[str, float]:
    """Weighted max-min shares of ``capacity``: each name gets at most its ``demand``
    (``math.inf``: all it can), what one leaves is shared by the others by weight."""
    left, out, active = capacity, dict.fromkeys(demand, 0.0), set(demand)
    while active and left > 1e-9:
        total_w = sum(weights.get(t, 1.0) for t in active)
        sated = {t for t in active if demand[t] - out[t] <= left * weights.get(t, 1.0) / total_w}
        if not sated:
            for t in active:
                out[t] += left * weights.get(t, 1.0) / total_w
            break
        for t in sated:
            left -= demand[t] - out[t]
            out[t] = demand[t]
        active -= sated
    return out


def tenant_caps(
    tenant: Tenant,
    b: Budget,
    usage: Mapping[str, tuple[int, int]] | None,
    asking: set[str],
    weights: Mapping[str, float],
    s: AdmissionSettings,
    hungry: set[str] | None = None,
) -> tuple[int | None, int | None, str]:
    """The most KV blocks and slots ``tenant`` may hold in the pool with this request in (None:
    no limit of its own), and why: its hard caps (``max_kv_share``, ``max_concurrency``) and,
    with the pool contended (``usage``: blocks and slots held per tenant), its weighted fair
    share among the tenants holding reservations or ``asking`` — only for a tenant already
    holding something, so every tenant can always run one request. The share is max-min
    (work-conserving): a tenant that was not refused or queued lately (not ``hungry``; None:
    every tenant asking counts as hungry) wants no more than it holds, and what it leaves is
    shared by the others by weight."""
    blocks = (
        int(tenant.max_kv_share * b.kv_blocks_total) if tenant.max_kv_share is not None else None
    )
    why = "max_kv_share"
    if usage is not None and usage.get(tenant.name, (0, 0))[1] > 0:
        active = {t for t, (_, slots) in usage.items() if slots > 0} | asking | {tenant.name}
        wanting = (asking if hungry is None else hungry) | {tenant.name}
        demand = {t: math.inf if t in wanting else float(usage.get(t, (0, 0))[0]) for t in active}
        limit = int(priority_limit(tenant.priority, s) * b.kv_blocks_total)
        share = int(water_fill(limit, demand, weights)[tenant.name])
        if blocks is None or share < blocks:
            blocks, why = share, f"fair share ({len(active)} tenants)"
    return blocks, tenant.max_concurrency, why


def below_yellow(
    ask: AdmissionAsk, s: AdmissionSettings, queued: bool, expected: int | None
) -> ReserveAsk | None:
    """The reservation :func:`admission.core.admit` would make for any priority below yellow,
    limited to yellow (so it holds only if the pool stays at or below yellow with it in:
    exactly then the core admits whatever the priority, and tenant caps are the tenant's own,
    no fair share) — or None: the full path decides (requests ``queued`` at or above its
    priority, a prompt larger than any node, an empty budget)."""
    nodes = ask.node_blocks
    yellow_blocks = int(s.yellow_watermark * sum(nodes))
    yellow_slots = int(s.yellow_watermark * len(nodes) * s.slots_per_node)
    if (
        yellow_blocks <= 0
        or yellow_slots <= 0
        or math.ceil(ask.prompt_tokens / ask.block_size) > max(nodes)
        or queued
    ):
        return None
    t = ask.tenant
    blocks = kv_blocks_for(
        ask.prompt_tokens, ask.max_tokens, ask.block_size, s, expected, ask.shape
    )
    caps = int(t.max_kv_share * sum(nodes)) if t.max_kv_share is not None else None
    return ReserveAsk(
        ask.request_id,
        ask.pool,
        blocks,
        yellow_blocks,
        s.lease_s,
        yellow_slots,
        t.name,
        caps,
        t.max_concurrency,
    )


def quota_refusal(
    tenant: Tenant, why: str, kv_blocks: int, usage: float, s: AdmissionSettings
) -> Verdict:
    """The tenant is at its own limit (``why``): a 429 to retry later."""
    return Verdict(
        False,
        kv_blocks,
        usage,
        Rejection(
            RejectReason.TENANT_QUOTA,
            True,
            max(s.min_retry_after_s, 1.0),
            f"tenant {tenant.name} is at its limit ({why}, max_concurrency "
            f"{tenant.max_concurrency})",
        ),
    )


def filled_up(verdict: Verdict, s: AdmissionSettings) -> Verdict:
    """Admitted on the snapshot, but the store's atomic check found the budget full (other
    routers reserved in between)."""
    return Verdict(
        False,
        verdict.kv_blocks,
        verdict.usage_after,
        Rejection(
            RejectReason.RED_WATERMARK,
            True,
            max(s.min_retry_after_s, 1.0),
            "the cluster KV budget filled up concurrently",
        ),
    )


def store_down(why: str) -> Verdict:
    """The reservation store cannot answer: nothing is admitted that the budget cannot see."""
    return Verdict(False, 0, 0.0, Rejection(RejectReason.STORE_UNAVAILABLE, True, 1.0, why))


def per_window(per_minute: int | None, s: AdmissionSettings) -> int | None:
    """A per-minute limit over ``admission.rate_window_s`` (at least 1)."""
    if per_minute is None:
        return None
    return max(1, math.floor(per_minute * s.rate_window_s / 60.0))


def rate_refusal(tenant: Tenant, wait_s: float, s: AdmissionSettings) -> Verdict:
    """Over the tenant's requests or tokens per minute: a 429 with the time until its window
    has room (not retriable when the prompt alone is over the token limit)."""
    never = math.isinf(wait_s)
    limits = (
        f"requests_per_minute {tenant.requests_per_minute}, "
        f"tokens_per_minute {tenant.tokens_per_minute}"
    )
    return Verdict(
        False,
        0,
        0.0,
        Rejection(
            RejectReason.RATE_LIMITED,
            not never,
            None if never else min(s.max_retry_after_s, max(s.min_retry_after_s, wait_s)),
            f"the prompt alone is over tenant {tenant.name}'s {limits}"
            if never
            else f"tenant {tenant.name} is over its rate ({limits})",
        ),
    )
