"""A simulated engine as the simulated router sees it: its core, its decode run in progress,
the view its heartbeat gives (:func:`node_view`), and the folding of its KV-cache events into
the router's prefix index (:func:`fold`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agents.kvcache import AllCleared, BlockRemoved, BlockStored, CacheEvent
from agents.scheduler import DecodeRun
from analytics.sim.simconfig import MODEL
from analytics.sim.simcore import SimCore, SimSeq
from analytics.sim.traces import TraceRequest
from router.decision.types import NodeView
from streams.blocks import HASH_MASK
from streams.prefix_index import PrefixIndex

__all__ = ["SimNode", "all_hashes", "fold", "node_view"]


@dataclass(slots=True)
class SimNode:
    node_id: str
    core: SimCore
    busy: bool = False
    view: NodeView | None = None  # the last heartbeat the router has
    served: int = 0
    run: DecodeRun | None = None  # a fast-forwarded decode run in progress
    run_start: float = 0.0
    run_applied: int = 0
    gen: int = 0  # bumps when a scheduled run end is replaced
    finishing: list[SimSeq] = field(default_factory=list)  # finished, delivered at run end


def node_view(
    n: SimNode,
    now: float,
    lease_s: float,
    draining: bool = False,
    started_at: float | None = None,
    role: str = "mixed",
    kv_pull: bool = False,
) -> NodeView:
    c = n.core
    return NodeView(
        node_id=n.node_id,
        endpoint=f"sim://{n.node_id}",
        model=MODEL,
        pool="default",
        block_size=c.profile.block_size,
        kv_blocks_total=c.cache.num_blocks,
        kv_blocks_used=c.cache.used_blocks,
        running=len(c.running),
        waiting=len(c.waiting),
        healthy=True,
        draining=draining,
        heartbeat_ts=now,
        lease_s=lease_s,
        started_at=started_at,
        role=role,
        kv_pull=kv_pull,
    )


def all_hashes(r: TraceRequest, idx: int, block_size: int) -> list[int]:
    """The prompt's block hashes, then the blocks its answer fills: the trace's, or hashes of
    the request's own (cheap, distinct from every other request's)."""
    hashes = list(r.block_hashes) + list(r.output_block_hashes)
    total = (r.prompt_tokens + r.output_tokens) // block_size
    base = (idx + 1) << 24
    hashes += [((base + i) * 0x9E3779B97F4A7C15) & HASH_MASK for i in range(len(hashes), total)]
    return hashes


def fold(index: PrefixIndex, node_id: str, events: list[CacheEvent]) -> None:
    """Apply one node's cache events to the index, in order (consecutive stores as one)."""
    stored: list[int] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            stored += ev.block_hashes
            continue
        if stored:
            index.add_many(node_id, stored)
            stored = []
        if isinstance(ev, BlockRemoved):
            index.remove_many(node_id, ev.block_hashes)
        elif isinstance(ev, AllCleared):
            index.drop_node(node_id)
    if stored:
        index.add_many(node_id, stored)
