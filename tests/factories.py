"""Valid topic values for tests and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from admission.core import Verdict
from admission.gate import AdmissionGate
from admission.plan import AdmissionAsk
from admission.reservations import Reservation, ReservationStore, ReserveAsk
from admission.settings import Tenant
from router.decision.types import NodeView, Policy, RouteDecision, RouteRequest
from streams.schemas import CandidateScore, Decision, Heartbeat, LedgerEvent, Outcome

NOW = 1000.0  # the clock of tests that build node views


def node_view(nid: str, used: int = 0, waiting: int = 0, running: int = 0, **kw: Any) -> NodeView:
    """A healthy node of model ``m`` as a heartbeat 0.2 s before :data:`NOW` described it."""
    args: dict[str, Any] = dict(
        node_id=nid,
        endpoint=f"http://{nid}",
        model="m",
        pool="default",
        block_size=16,
        kv_blocks_total=100,
        kv_blocks_used=used,
        running=running,
        waiting=waiting,
        healthy=True,
        draining=False,
        heartbeat_ts=NOW - 0.2,
        lease_s=2.0,
    )
    args.update(kw)
    return NodeView(**args)


def take(
    policy: Policy,
    req: RouteRequest,
    nodes: Sequence[NodeView],
    matches: Mapping[str, int] | None = None,
    now: float = NOW,
) -> RouteDecision:
    """``policy`` decides and the request is sent where it said (the router's commit): what a
    routed request teaches the policy, it learns."""
    matches = matches or {}
    d = policy.decide(req, nodes, matches, now)
    hit = matches.get(d.chosen or "", 0)
    policy.commit(req, d, max(0, req.prompt_tokens - 16 * hit), now)
    return d


def heartbeat(
    node: str, seq: int = 0, epoch: str = "e", ts: float | None = None, **fields: Any
) -> Heartbeat:
    values: dict[str, Any] = {
        "endpoint": f"http://{node}",
        "model": "m",
        "block_size": 16,
        "kv_blocks_total": 100,
        "kv_blocks_used": 0,
        "running": 0,
        "waiting": 0,
    }
    values.update(fields)
    return Heartbeat(
        node_id=node, epoch=epoch, seq=seq, ts=time.time() if ts is None else ts, **values
    )


def decision(request_id: str, ts: float | None = None, **fields: Any) -> Decision:
    values: dict[str, Any] = {
        "router_id": "router",
        "model": "m",
        "prompt_tokens": 64,
        "max_tokens": 8,
        "block_size": 16,
        "block_hashes": [11, 12, 13, 14],
        "policy": "kvgate",
        "chosen_node": "n1",
        "reason": "prefix_hit",
        "decision_us": 120.0,
        "kv_blocks_estimate": 6,
        "candidates": [
            CandidateScore(
                node_id="n1",
                score=0.1,
                hit_blocks=4,
                hit_fraction=1.0,
                kv_used_ratio=0.2,
                queue_len=0,
                healthy=True,
            )
        ],
    }
    values.update(fields)
    return Decision(request_id=request_id, ts=time.time() if ts is None else ts, **values)


def outcome(request_id: str, ts: float | None = None, **fields: Any) -> Outcome:
    values: dict[str, Any] = {
        "router_id": "router",
        "node_id": "n1",
        "status": "ok",
        "http_status": 200,
        "ttft_s": 0.05,
        "tpot_s": 0.01,
        "e2e_s": 0.2,
        "prompt_tokens": 64,
        "output_tokens": 8,
        "cached_tokens": 48,
    }
    values.update(fields)
    return Outcome(request_id=request_id, ts=time.time() if ts is None else ts, **values)


def ledger_event(rid: str, kind: str, ts: float | None = None, **fields: Any) -> LedgerEvent:
    values: dict[str, Any] = {"kv_blocks": 6, "router_id": "router"}
    values.update(fields)
    return LedgerEvent(
        reservation_id=rid, kind=kind, ts=time.time() if ts is None else ts, **values
    )


def admission_ask(
    rid: str,
    tenant: Tenant,
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    pool: str,
    nodes: Sequence[int],
    model: str = "",
    attempt: str = "",
    client: str = "",
) -> AdmissionAsk:
    return AdmissionAsk(
        rid,
        tenant,
        prompt_tokens,
        max_tokens,
        block_size,
        pool,
        nodes,
        model,
        attempt=attempt,
        client=client,
    )


async def admit(
    gate: AdmissionGate,
    rid: str,
    tenant: Tenant,
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    pool: str,
    nodes: Sequence[int],
    now: float,
    model: str = "",
) -> Verdict:
    """``gate.admit`` of a request given by its fields."""
    ask = admission_ask(rid, tenant, prompt_tokens, max_tokens, block_size, pool, nodes, model)
    return await gate.admit(ask, now)


async def screen(
    gate: AdmissionGate,
    rid: str,
    tenant: Tenant,
    attempt: str,
    client: str,
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    pool: str,
    nodes: Sequence[int],
    now: float,
    model: str = "",
) -> Verdict:
    """``gate.screen_and_admit`` of a request given by its fields."""
    ask = admission_ask(
        rid, tenant, prompt_tokens, max_tokens, block_size, pool, nodes, model, attempt, client
    )
    return await gate.screen_and_admit(ask, now)


async def reserve(
    store: ReservationStore,
    rid: str,
    pool: str,
    kv_blocks: int,
    limit_blocks: int,
    now: float,
    lease_s: float,
    limit_slots: int | None = None,
    tenant: str = "",
) -> Reservation | Literal["tenant"] | None:
    """``store.try_reserve`` of a reservation given by its fields."""
    ask = ReserveAsk(rid, pool, kv_blocks, limit_blocks, lease_s, limit_slots, tenant)
    return await store.try_reserve(ask, now)
