"""Prefill/decode disaggregation: choosing a (prefill, decode) pair, and the two requests of
vLLM's disaggregated flow through a KV connector (NixlConnector), pure.

Nodes have a role (``Heartbeat.role``): ``mixed`` nodes serve whole requests, ``prefill`` nodes
compute prompts, ``decode`` nodes generate from KV they receive. When a model has both prefill
and decode nodes, a request may be split:

* **P** is chosen by the policy among the prefill nodes as a one-token request: prefix-cache hit
  and prefill queue decide;
* **D** is chosen among the decode nodes as if it held the whole prompt (it will, once the KV
  arrives): free KV and decode batch decide; the transfer — the prompt's KV bytes over the
  node's link — is added to its cost;
* with mixed nodes too, the split is taken only when its cost (P's queue and prefill, the
  transfer, D's decode) is below the best mixed node's (policies that give cost components;
  others split whenever they can).

The proxy then sends P the request with ``kv_transfer_params`` asking for remote decode,
``max_tokens`` 1, not streamed; P answers with the params D needs (its engine id, block ids,
side channel); D gets the original request with those params and streams the answer. Clients
never set ``kv_transfer_params`` (router/parse.py refuses them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from admission.slo import expected_ttft_s
from router.decision.types import Candidate, NodeView, Policy, RouteDecision, RouteRequest

__all__ = [
    "PdPlan",
    "colocated_cost",
    "decide_roles",
    "decode_body",
    "plan_pd",
    "prefill_body",
    "remote_decode_params",
    "split_roles",
    "transfer_s",
    "valid_transfer_params",
]

MAX_BLOCK_IDS = 1 << 20


@dataclass(frozen=True, slots=True)
class PdPlan:
    prefill: RouteDecision  # ``chosen``: the prefill node
    decode: RouteDecision  # ``chosen``: the decode node
    cost_s: float | None  # P's queue and prefill + transfer + D's cost (None: no components)
    transfer_s: float


def split_roles(
    nodes: Sequence[NodeView],
) -> tuple[list[NodeView], list[NodeView], list[NodeView]]:
    """Mixed, prefill and decode nodes."""
    mixed: list[NodeView] = []
    pre: list[NodeView] = []
    dec: list[NodeView] = []
    for n in nodes:
        (pre if n.role == "prefill" else dec if n.role == "decode" else mixed).append(n)
    return mixed, pre, dec


def transfer_s(prompt_tokens: int, kv_bytes_per_token: int, link_gbps: float) -> float:
    """Seconds to move a prompt's KV between engines."""
    return prompt_tokens * kv_bytes_per_token * 8 / (link_gbps * 1e9)


def plan_pd(
    policy: Policy,
    rreq: RouteRequest,
    prefill_nodes: Sequence[NodeView],
    decode_nodes: Sequence[NodeView],
    matches: Mapping[str, int],
    now: float,
    *,
    kv_bytes_per_token: int,
    default_link_gbps: float,
) -> PdPlan | None:
    """The (prefill, decode) pair for ``rreq``, or None when either side has no node."""
    p = policy.decide(replace(rreq, max_tokens=1), prefill_nodes, matches, now)
    if p.chosen is None:
        return None

    def moved(n: NodeView) -> float:
        return transfer_s(
            rreq.prompt_tokens, kv_bytes_per_token, n.kv_link_gbps or default_link_gbps
        )

    costing = getattr(getattr(policy, "model", None), "cost", None)  # its cost model's prices
    if callable(costing):
        d = _cheapest_decode(costing, rreq, decode_nodes, moved)
    else:  # a policy without a cost model: its own choice, as if the node held the prompt
        whole = len(rreq.block_hashes)
        d = policy.decide(rreq, decode_nodes, {n.node_id: whole for n in decode_nodes}, now)
    if d.chosen is None:
        return None
    dnode = next(n for n in decode_nodes if n.node_id == d.chosen)
    pc, dc = p.chosen_candidate, d.chosen_candidate
    cost = None
    if pc is not None and dc is not None and callable(costing):
        # P's queue and prefill as weighted in the cost, then D's whole cost
        cost = (expected_ttft_s(pc.components, 1.0, 1.0) or 0.0) - dc.score
    return PdPlan(p, d, cost, moved(dnode))


def _cheapest_decode(
    costing: Any,
    rreq: RouteRequest,
    nodes: Sequence[NodeView],
    moved: Any,
) -> RouteDecision:
    """The decode node where the request costs least: the transfer, the queue ahead of it, its
    decode, and the KV pressure of the whole prompt plus its output (the prompt arrives, so
    no prefill — but its blocks are held there)."""
    best: Candidate | None = None
    whole = len(rreq.block_hashes)
    for n in nodes:
        parts = dict(costing(rreq, n, 0))
        parts["transfer_s"] = moved(n)
        total = parts["queue_s"] + parts["decode_s"] + parts["kv_s"] + parts["transfer_s"]
        c = Candidate(n.node_id, -total, whole, 1.0, n.kv_used_ratio, n.queue_len, n.healthy, parts)
        if best is None or c.score > best.score:
            best = c
    if best is None:
        return RouteDecision(None, "no_healthy_node", ())
    return RouteDecision(best.node_id, "disaggregated", (best,))


def decide_roles(
    policy: Policy,
    rreq: RouteRequest,
    nodes: Sequence[NodeView],
    matches: Mapping[str, int],
    now: float,
    *,
    disaggregate: bool,
    kv_bytes_per_token: int,
    default_link_gbps: float,
) -> RouteDecision:
    """The decision over the nodes' roles: mixed nodes serve whole requests; a (prefill,
    decode) pair (``RouteDecision.prefill``, reason ``disaggregated``) when the model has both
    and the split costs less than the best mixed node; without a usable mixed node and no
    pair, any node computes the request whole."""
    mixed, pre, dec = split_roles(nodes)
    if not pre and not dec:
        return policy.decide(rreq, nodes, matches, now)
    colocated = policy.decide(rreq, mixed, matches, now) if mixed else None
    if disaggregate and pre and dec:
        plan = plan_pd(
            policy,
            rreq,
            pre,
            dec,
            matches,
            now,
            kv_bytes_per_token=kv_bytes_per_token,
            default_link_gbps=default_link_gbps,
        )
        mixed_cost = colocated_cost(colocated) if colocated is not None else None
        if plan is not None and (
            colocated is None
            or colocated.chosen is None
            or (plan.cost_s is not None and mixed_cost is not None and plan.cost_s < mixed_cost)
        ):
            pc = plan.prefill.chosen_candidate
            return RouteDecision(
                plan.decode.chosen,
                "disaggregated",
                plan.decode.candidates + ((pc,) if pc is not None else ()),
                prefill=plan.prefill.chosen,
            )
    if colocated is not None and colocated.chosen is not None:
        return colocated
    return policy.decide(rreq, nodes, matches, now)


def colocated_cost(d: RouteDecision) -> float | None:
    """The chosen mixed node's cost (None: the policy gives no components)."""
    c = d.chosen_candidate
    if c is None or not c.components:
        return None
    return -c.score


def remote_decode_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` of a first leg (vLLM's disaggregated flow): compute, keep the
    KV for a remote engine, answer with where it is."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request P gets: the prompt, one token, not streamed, KV kept for a remote decode
    (vLLM's disaggregated flow; min_tokens are D's to honour)."""
    out = {
        k: v
        for k, v in body.items()
        if k not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    out["kv_transfer_params"] = remote_decode_params()
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def valid_transfer_params(answer: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of P's answer, when they are what a decode engine can use
    (bounded, the expected shape); None otherwise (D then computes the prompt itself)."""
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    ids = params.get("remote_block_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) > MAX_BLOCK_IDS):
        return None
    for key in ("remote_engine_id", "remote_host", "remote_request_id"):
        v = params.get(key)
        if v is not None and (not isinstance(v, str) or len(v) > 256):
            return None
    return params


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The request D gets: the client's, with P's transfer params."""
    return {**body, "kv_transfer_params": dict(params)}
