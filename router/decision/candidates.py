"""Which nodes a request may be admitted to and routed among, and the budget it draws on
(pure; the live router at admission and the simulator alike).

* **Eligible**: nodes serving the request's model (or its adapter), healthy, not draining,
  alive.
* **Open**: eligible nodes whose queue is within ``max_queue``. When what is open holds less
  than ``min_open_share`` of the *eligible* nodes' KV capacity, the fleet is backed up: the
  request is refused (503 with ``Retry-After``: a bounded queue, not a pile on the few nodes
  still open). Nodes that are down, drained or gone do not count against it: a fleet of which
  most is away is *degraded* (:func:`healthy_share`), not switched off — its requests are
  admitted against the budget of the nodes left (:func:`budget`: the candidates' KV), so
  admission sheds what they cannot carry, by priority, the watermarks and the tenants' shares,
  and refuses the rest with its ``Retry-After``.
* **Placement**: only nodes with the request's required labels (none: 503), its preferred ones
  while they have room (router/decision/placement.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from admission.core import Rejection, RejectReason
from admission.pools import budget_key
from router.decision.placement import FREE, Placement
from router.decision.types import NodeView, eligible

__all__ = ["budget", "budget_totals", "candidates", "healthy_share", "open_candidates"]


def open_candidates(
    all_nodes: Sequence[NodeView],
    model: str,
    now: float,
    max_queue: int,
    min_open_share: float,
    retry_after_s: float,
) -> list[NodeView] | Rejection:
    """The eligible nodes for ``model`` within the queue cap, or the backed-up refusal."""
    nodes = eligible(all_nodes, model, now)
    open_nodes = [n for n in nodes if n.waiting <= max_queue]
    healthy = sum(n.kv_blocks_total for n in nodes)
    share = sum(n.kv_blocks_total for n in open_nodes) / healthy if healthy else 0.0
    if nodes and share < min_open_share:
        return Rejection(
            RejectReason.NODES_UNHEALTHY,
            True,
            retry_after_s,
            f"the nodes are backed up: only {share:.0%} of the healthy nodes' KV capacity has "
            f"at most {max_queue} requests waiting",
        )
    return open_nodes or nodes


def healthy_share(all_nodes: Sequence[NodeView], model: str, now: float) -> float:
    """The share of ``model``'s known KV capacity on eligible nodes (healthy, not draining,
    alive; 1: no node known): under ``admission.min_healthy_share`` the fleet is degraded."""
    known = healthy = 0
    for n in all_nodes:
        if n.model == model or model in n.adapters:
            known += n.kv_blocks_total
            if n.healthy and not n.draining and now - n.heartbeat_ts <= n.lease_s:
                healthy += n.kv_blocks_total
    return healthy / known if known else 1.0


def candidates(
    all_nodes: Sequence[NodeView],
    model: str,
    now: float,
    max_queue: int,
    min_open_share: float,
    retry_after_s: float,
    placement: Placement = FREE,
) -> list[NodeView] | Rejection:
    """:func:`open_candidates`, then the request's placement."""
    nodes = open_candidates(all_nodes, model, now, max_queue, min_open_share, retry_after_s)
    if isinstance(nodes, Rejection) or placement.free or not nodes:
        return nodes
    allowed = placement.allowed(nodes)
    if not allowed:
        return Rejection(
            RejectReason.NO_CAPACITY,
            True,
            retry_after_s,
            f"no healthy node of this model has the labels {placement.describe()}",
        )
    return placement.preferred(allowed)


def budget(
    all_nodes: Sequence[NodeView],
    nodes: Sequence[NodeView],
    model: str,
    now: float,
    adapter_base: Mapping[str, str],
    placed: bool = False,
) -> tuple[str, list[int]]:
    """The admission budget a request for ``model`` draws on (admission.pools): its name and
    the KV blocks of each of its nodes — the eligible nodes of the candidates' pool that run
    their base model (an adapter's requests share their base model's KV). ``nodes``: the
    candidates; ``placed``: narrowed by placement labels; ``adapter_base``: adapter → base
    model, for a request without candidates."""
    if not nodes:
        base = adapter_base.get(model, model)
        return budget_key("default", base), []
    pool, base = nodes[0].pool, nodes[0].model
    if model == base and not placed:  # the candidates are the base model's nodes
        group = [n for n in nodes if n.pool == pool]
    else:  # an adapter's nodes or a placement's subset: the whole base model's
        group = [n for n in eligible(all_nodes, base, now) if n.pool == pool and n.model == base]
    return budget_key(pool, base), [n.kv_blocks_total for n in group or nodes]


def budget_totals(views: Sequence[NodeView], now: float) -> dict[str, int]:
    """Every (pool, model) budget's KV blocks: its healthy, undrained, live nodes'."""
    return {key: sum(blocks) for key, blocks in budget_nodes(views, now).items()}


def budget_nodes(views: Sequence[NodeView], now: float) -> dict[str, list[int]]:
    """Every (pool, model) budget's healthy, undrained, live nodes' KV blocks, a node each (a
    budget whose nodes are all gone: none)."""
    out: dict[str, list[int]] = {}
    for v in views:
        blocks = out.setdefault(budget_key(v.pool, v.model), [])
        if v.healthy and not v.draining and v.alive(now):
            blocks.append(v.kv_blocks_total)
    return out
