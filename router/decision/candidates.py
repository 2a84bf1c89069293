"""Which nodes a request may be admitted to and routed among, and the budget it draws on
(pure; the live router at admission and the simulator alike).

* **Eligible**: nodes serving the request's model (or its adapter), healthy, not draining,
  alive.
* **Open**: eligible nodes whose queue is within ``max_queue``. When every eligible node is over
  the cap, all of them stay candidates (the policy's overload rules then decide). A fleet of
  which little is open (:func:`healthy_share` under ``admission.min_healthy_share``: nodes
  down, drained or backed up) is *degraded*, not switched off: its requests are admitted
  against the budget of what is open (:func:`budget`: the candidates' KV), so admission sheds
  what the nodes left cannot carry — by priority, the watermarks and the tenants' shares — and
  refuses the rest with its ``Retry-After``, instead of refusing every request while most of
  the fleet is away.
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
    all_nodes: Sequence[NodeView], model: str, now: float, max_queue: int
) -> list[NodeView]:
    """The eligible nodes for ``model`` within the queue cap (all eligible ones when none is)."""
    nodes = eligible(all_nodes, model, now)
    open_nodes = [n for n in nodes if n.waiting <= max_queue]
    return open_nodes or nodes


def healthy_share(
    all_nodes: Sequence[NodeView], open_nodes: Sequence[NodeView], model: str
) -> float:
    """The share of ``model``'s known KV capacity that ``open_nodes`` hold (1: no node known)."""
    known = sum(n.kv_blocks_total for n in all_nodes if n.serves(model))
    return sum(n.kv_blocks_total for n in open_nodes) / known if known else 1.0


def candidates(
    all_nodes: Sequence[NodeView],
    model: str,
    now: float,
    max_queue: int,
    retry_after_s: float,
    placement: Placement = FREE,
) -> list[NodeView] | Rejection:
    """:func:`open_candidates`, then the request's placement."""
    nodes = open_candidates(all_nodes, model, now, max_queue)
    if placement.free or not nodes:
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
    out: dict[str, int] = {}
    for v in views:
        key = budget_key(v.pool, v.model)
        ok = v.healthy and not v.draining and v.alive(now)
        out[key] = out.get(key, 0) + (v.kv_blocks_total if ok else 0)
    return out
