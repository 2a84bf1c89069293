"""Fragmentation and fit: a request goes only where its KV fits.

The cluster's budget (admission) can have room while no single node has enough for one long
prompt: the room is spread thin. Each node's heartbeat says how many blocks the largest request
it could admit now may take (free plus evictable, minus the engine's watermark:
``kv_blocks_admissible``; routers derive it from the used and total blocks when an older agent
does not say). For a request:

* **never fits** — its prompt needs more blocks than any eligible node has at all (after the
  watermark), or reaches every node's context limit (``max_model_len``): 413, a client error;
* **does not fit now** — some node could hold it, none can now: 503 with Retry-After;
* otherwise only the nodes where its new blocks (the prompt's, less the prefix the node holds)
  fit now are candidates — and the nodes holding a prefix of it, full or not, when its new
  blocks are few (at most :data:`QUEUE_SHARE` of the node's capacity): the engine queues such a
  request until its running requests free that much, which they do within a decode, where
  another node would compute the whole prompt again and fill with a copy of it (on a loaded
  cluster whose engines keep their KV full, sending a prefix's followers away from its full
  holders copied the prompts over every node, evicted the others' and halved the hit rate).

The live router and the simulator filter through the same pipeline step
(``router/decision/pipeline.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.decision.types import NodeView
from streams.fit import admissible_blocks

__all__ = [
    "FIT_WATERMARK",
    "QUEUE_SHARE",
    "UNFIT",
    "Fit",
    "fit",
    "fit_floor_tokens",
    "nearest",
    "node_admissible_blocks",
    "node_capacity_blocks",
    "over_limits",
    "queues_on_holder",
]

FIT_WATERMARK = 0.01  # vLLM's block-manager watermark, for nodes whose heartbeat has no figure
UNFIT = frozenset({"too_large", "no_fit_now"})  # the route decisions' reasons when nothing fits
QUEUE_SHARE = 0.1  # of a node's KV blocks: what a request hitting there may wait on it for


def queues_on_holder(new_blocks: int, cached_blocks: int, total_blocks: int) -> bool:
    """Whether a request that holds ``cached_blocks`` of its prompt on a node and needs
    ``new_blocks`` more goes there even when the node has no room now (see the module)."""
    return cached_blocks > 0 and new_blocks <= QUEUE_SHARE * total_blocks


def over_limits(
    n: NodeView, prompt_tokens: int, hit: int, max_queue: int, max_kv_used_ratio: float
) -> bool:
    """``n`` is over its limits for a request of ``prompt_tokens`` that hits ``hit`` blocks
    there: more than ``max_queue`` waiting, or the request's new prompt blocks (what it does
    not hit there) do not fit under ``max_kv_used_ratio`` of the node's KV. A hit needs few new
    blocks: a node whose running requests fill its KV still takes the requests that share their
    prefix (the engine schedules them as blocks free, :func:`queues_on_holder`), where a ratio
    test would send them to a node that must prefill the whole prompt and evict for it — the
    miss that fills that node next."""
    if n.queue_len > max_queue:
        return True
    total = n.kv_blocks_total
    if total <= 0:
        return n.kv_used_ratio >= max_kv_used_ratio
    bs = n.block_size
    new = -(-max(1, prompt_tokens - hit * bs) // bs)
    if queues_on_holder(new, hit, total):  # it waits there for its few blocks
        return False
    return n.kv_blocks_used + new > max_kv_used_ratio * total


def node_admissible_blocks(n: NodeView) -> int:
    if n.kv_blocks_admissible is not None:
        return n.kv_blocks_admissible
    return admissible_blocks(n.kv_blocks_total, n.kv_blocks_used, FIT_WATERMARK)


def node_capacity_blocks(n: NodeView) -> int:
    """The most any one request can ever take there: everything but the watermark."""
    return admissible_blocks(n.kv_blocks_total, 0, FIT_WATERMARK)


def fit_floor_tokens(n: NodeView) -> int:
    """The longest prompt that fits on ``n`` now even with nothing of it cached: a prompt no
    longer than every node's floor fits everywhere (the filter has nothing to do)."""
    bs = n.block_size
    tokens = min(node_admissible_blocks(n), node_capacity_blocks(n)) * bs
    return tokens if n.max_model_len is None else min(tokens, n.max_model_len - 1)


@dataclass(frozen=True, slots=True)
class Fit:
    nodes: list[NodeView]  # where the request fits now
    ever: bool  # some node could ever hold it
    largest_now_blocks: int  # over the nodes given
    largest_ever_blocks: int


def fit(nodes: Sequence[NodeView], prompt_tokens: int, matches: Mapping[str, int]) -> Fit:
    """The nodes of ``nodes`` where a prompt of ``prompt_tokens`` fits now (``matches``: the
    prefix blocks each node holds), and whether any could ever hold it. On the decision path:
    one pass of plain arithmetic per node, and ``nodes`` itself (no copy) when all fit."""
    kept: list[NodeView] | None = None  # built only once a node is left out
    ever = False
    largest_now = largest_ever = 0
    hit = matches.get
    for i, n in enumerate(nodes):
        need = -(-prompt_tokens // n.block_size)
        total = n.kv_blocks_total
        cap = total - math.ceil(FIT_WATERMARK * total)
        room = n.kv_blocks_admissible
        if room is None:
            room = cap - n.kv_blocks_used
            if room < 0:
                room = 0
        if cap > largest_ever:
            largest_ever = cap
        if room > largest_now:
            largest_now = room
        limit = n.max_model_len
        ok = need <= cap and (limit is None or prompt_tokens < limit)
        if ok:
            ever = True
            cached = hit(n.node_id, 0)
            new = need - (cached if cached < need else need)
            ok = new <= room or queues_on_holder(new, cached, total)
        if not ok and kept is None:
            kept = list(nodes[:i])
        elif ok and kept is not None:
            kept.append(n)
    return Fit(list(nodes) if kept is None else kept, ever, largest_now, largest_ever)


def nearest(
    nodes: Sequence[NodeView], prompt_tokens: int, matches: Mapping[str, int]
) -> list[NodeView]:
    """Of ``nodes`` that could ever hold the prompt, those nearest to having room for it now
    (the fewest new blocks short of what they can admit, ties all kept): where a request that
    fits nowhere now waits the least in the engine's queue. ``nodes`` itself where none could."""
    best: list[NodeView] = []
    least = math.inf
    for n in nodes:
        need = -(-prompt_tokens // n.block_size)
        if need > node_capacity_blocks(n) or (
            n.max_model_len is not None and prompt_tokens >= n.max_model_len
        ):
            continue
        short = need - min(need, matches.get(n.node_id, 0)) - node_admissible_blocks(n)
        if short < least:
            best, least = [n], short
        elif short == least:
            best.append(n)
    return best or list(nodes)
