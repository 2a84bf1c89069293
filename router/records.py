"""Decision and outcome events for ``kvgate.decisions`` / ``kvgate.outcomes`` (pure builders)."""

from __future__ import annotations

from typing import Any, Literal

from admission.core import Verdict
from router.decision.types import NodeView, RouteDecision, RouteRequest
from router.flow.served import Served
from router.parse import ParsedRequest
from streams.schemas import Decision, EndpointKind, Outcome, PassthroughKind

__all__ = [
    "MAX_RECORDED_BLOCKS",
    "admission_fields",
    "decision_fields",
    "decision_record",
    "listing_record",
    "outcome_fields",
    "outcome_record",
    "passthrough_outcome",
    "passthrough_record",
]

# a record's prompt blocks: enough for any prompt an engine holds (a million tokens at 64 per
# block), and a record the broker always takes (Kafka's default limit is 1 MiB)
MAX_RECORDED_BLOCKS = 16_384


def refusal_record(
    request_id: str,
    started: float,
    reason: str,
    p: ParsedRequest | None,
    *,
    router_id: str,
    tenant: str,
    policy: str,
    weights_version: int,
    block_size: int,
    client_request_id: str | None,
) -> Decision:
    """The record of a request refused before admission (bad input, credentials, unknown
    model, unhealthy cluster): what is known of it, no candidates."""
    return Decision(
        request_id=request_id,
        ts=started,
        router_id=router_id,
        tenant=tenant,
        model=(p.model if p is not None else "")[:200],
        endpoint_kind=p.kind if p is not None else "completions",
        prompt_tokens=p.prompt_tokens_total if p is not None else 0,
        max_tokens=p.max_tokens if p is not None else 0,
        block_size=block_size,
        admission="rejected",
        admission_reason=reason,
        policy=policy,
        weights_version=weights_version,
        chosen_node=None,
        reason="refused_before_admission",
        decision_us=0.0,
        client_request_id=client_request_id,
    )


def decision_record(
    rreq: RouteRequest,
    p: ParsedRequest,
    d: RouteDecision,
    **kw: Any,
) -> Decision:
    """:func:`decision_fields` as the model (what reads it back gets the same)."""
    return Decision.model_validate(decision_fields(rreq, p, d, **kw))


def decision_fields(
    rreq: RouteRequest,
    p: ParsedRequest,
    d: RouteDecision,
    *,
    router_id: str,
    policy: str,
    weights_version: int,
    started: float,
    block_size: int,
    decision_us: float,
    index_age_s: float | None,
    approximate_nodes: frozenset[str] | set[str] = frozenset(),
    tenant: str = "default",
    priority: str = "normal",
    admission: str = "admitted",
    admission_reason: str = "ok",
    budget_usage: float | None = None,
    kv_blocks_estimate: int | None = None,
    output_tokens_estimate: int | None = None,
    queue_wait_s: float | None = None,
    client_request_id: str | None = None,
    decision_seq: int = 0,
) -> dict[str, Any]:
    """A routed request's decision record, as the fields of :class:`Decision` (the router
    sends it through :func:`streams.trusted.record_json`: built here, it needs no second
    validation on the way out)."""
    return {
        "request_id": rreq.request_id,
        "ts": started,
        "router_id": router_id,
        "tenant": tenant,
        "priority": priority,
        "model": p.model,
        "session_id": p.session_id,
        "endpoint_kind": p.kind,
        "prompt_tokens": p.prompt_tokens_total,
        "max_tokens": p.max_tokens,
        "block_size": block_size,
        "block_hashes": rreq.block_hashes[:MAX_RECORDED_BLOCKS],  # (a prompt of any size)
        "approximate_tokens": not p.exact_tokens,
        "admission": admission,
        "admission_reason": admission_reason,
        "budget_usage": budget_usage,
        "kv_blocks_estimate": kv_blocks_estimate,
        "output_tokens_estimate": output_tokens_estimate,
        "queue_wait_s": queue_wait_s,
        "policy": policy,
        "weights_version": weights_version,
        "chosen_node": d.chosen,
        "reason": d.reason,
        "prefill_node": d.prefill,
        "pull_node": d.pull,
        "pull_blocks": d.pull_blocks,
        "candidates": [
            {
                "node_id": c.node_id,
                "score": c.score,
                "hit_blocks": c.hit_blocks,
                "hit_fraction": c.hit_fraction,
                "kv_used_ratio": c.kv_used_ratio,
                "queue_len": c.queue_len,
                "healthy": c.healthy,
                "components": c.components,
                "approximate_index": c.node_id in approximate_nodes,
            }
            for c in d.candidates
        ],
        "index_age_s": index_age_s,
        "decision_us": decision_us,
        "client_request_id": client_request_id,
        "decision_seq": decision_seq,
    }


def _reason(verdict: Verdict) -> str:
    if verdict.rejection is not None:
        return verdict.rejection.reason
    # admitted within this router's share while the shared store was away (admission/failover)
    return "local_share" if verdict.local_share else "ok"


def admission_fields(verdict: Verdict | None) -> dict[str, Any]:
    """What a decision record says of admission's ``verdict`` (None: admission is off)."""
    if verdict is None:
        return {"admission": "admitted", "admission_reason": "disabled"}
    return {
        "admission": "admitted" if verdict.admitted else "rejected",
        "admission_reason": _reason(verdict),
        "budget_usage": verdict.usage_after,
        "kv_blocks_estimate": verdict.kv_blocks,
        "output_tokens_estimate": verdict.output_estimate,
        "queue_wait_s": verdict.queue_wait_s,
    }


def passthrough_record(
    request_id: str,
    kind: PassthroughKind,
    model: str,
    node: NodeView,
    verdict: Verdict | None,
    *,
    router_id: str,
    tenant: str,
    priority: str,
    started: float,
    client_request_id: str | None,
) -> Decision:
    """A non-generating request's decision (router/http/passthrough.py): the least loaded
    node of its model, no tokens counted, no candidates."""
    refused = verdict is not None and not verdict.admitted
    return _untokened(
        request_id,
        kind,
        model,
        node.pool,
        node.block_size,
        None if refused else node.node_id,
        "refused" if refused else "least_loaded",
        router_id=router_id,
        tenant=tenant,
        priority=priority,
        started=started,
        client_request_id=client_request_id,
        **admission_fields(verdict),
    )


def listing_record(
    request_id: str,
    *,
    router_id: str,
    tenant: str,
    priority: str,
    started: float,
    block_size: int,
    client_request_id: str | None,
) -> Decision:
    """``GET /v1/models``: answered by the router from what the nodes report, no engine used
    (nothing admitted, no node)."""
    return _untokened(
        request_id,
        "models",
        "*",
        "default",
        block_size,
        None,
        "model_list",
        router_id=router_id,
        tenant=tenant,
        priority=priority,
        started=started,
        client_request_id=client_request_id,
        admission="admitted",
        admission_reason="no_engine",
    )


def _untokened(
    request_id: str,
    kind: EndpointKind,
    model: str,
    pool: str,
    block_size: int,
    chosen: str | None,
    reason: str,
    *,
    started: float,
    **fields: Any,
) -> Decision:
    """The decision of a request that counts no tokens and weighs no candidates (policy
    ``passthrough``)."""
    return Decision(
        request_id=request_id,
        model=model,
        pool=pool,
        endpoint_kind=kind,
        prompt_tokens=0,
        max_tokens=0,
        block_size=block_size,
        policy="passthrough",
        chosen_node=chosen,
        reason=reason,
        decision_us=0.0,
        ts=started,
        **fields,
    )


def passthrough_outcome(
    request_id: str,
    node: NodeView,
    status: Literal["ok", "error", "cancelled"],
    http_status: int,
    *,
    router_id: str,
    started: float,
    now: float,
    error: str | None,
) -> Outcome:
    """What became of a non-generating request: its status and time, no tokens counted."""
    return Outcome(
        request_id=request_id,
        ts=now,
        router_id=router_id,
        node_id=node.node_id,
        status=status,
        http_status=http_status,
        e2e_s=max(0.0, now - started),
        prompt_tokens=0,
        output_tokens=0,
        error=error,
    )


def outcome_record(
    request_id: str,
    node: str | None,
    relay: Served,
    p: ParsedRequest,
    **kw: Any,
) -> Outcome:
    """:func:`outcome_fields` as the model."""
    return Outcome.model_validate(outcome_fields(request_id, node, relay, p, **kw))


def outcome_fields(
    request_id: str,
    node: str | None,
    relay: Served,
    p: ParsedRequest,
    *,
    router_id: str,
    started: float,
    now: float,
    reroutes: int = 0,
    resumes: int = 0,
) -> dict[str, Any]:
    """What became of a routed request, as the fields of :class:`Outcome` (sent through
    :func:`streams.trusted.record_json`, as a decision is)."""
    e2e = now - started
    ttft, n = relay.ttft_s, relay.output_tokens
    tpot = (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None
    return {
        "request_id": request_id,
        "ts": now,
        "router_id": router_id,
        "node_id": node,
        "status": relay.status,
        "http_status": relay.http_status,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_s": e2e,
        "prompt_tokens": p.prompt_tokens_total,
        "output_tokens": n,
        "cached_tokens": relay.cached_tokens,
        "reroutes": reroutes,
        "resumes": resumes,
        "error": relay.error,
    }
