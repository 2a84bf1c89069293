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
  fit now are candidates.

The live router (``router/service.py``) and the simulator (``analytics/sim/cluster.py``) filter
with the same function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.core import NodeView
from streams.fit import admissible_blocks

__all__ = [
    "FIT_WATERMARK",
    "UNFIT",
    "Fit",
    "fit",
    "node_admissible_blocks",
    "node_capacity_blocks",
]

FIT_WATERMARK = 0.01  # vLLM's block-manager watermark, for nodes whose heartbeat has no figure
UNFIT = frozenset({"too_large", "no_fit_now"})  # the route decisions' reasons when nothing fits


def node_admissible_blocks(n: NodeView) -> int:
    if n.kv_blocks_admissible is not None:
        return n.kv_blocks_admissible
    return admissible_blocks(n.kv_blocks_total, n.kv_blocks_used, FIT_WATERMARK)


def node_capacity_blocks(n: NodeView) -> int:
    """The most any one request can ever take there: everything but the watermark."""
    return admissible_blocks(n.kv_blocks_total, 0, FIT_WATERMARK)


@dataclass(frozen=True, slots=True)
class Fit:
    nodes: list[NodeView]  # where the request fits now
    ever: bool  # some node could ever hold it
    largest_now_blocks: int  # over the nodes given
    largest_ever_blocks: int


def fit(nodes: Sequence[NodeView], prompt_tokens: int, matches: Mapping[str, int]) -> Fit:
    """The nodes of ``nodes`` where a prompt of ``prompt_tokens`` fits now (``matches``: the
    prefix blocks each node holds), and whether any could ever hold it."""
    now: list[NodeView] = []
    ever = False
    largest_now = largest_ever = 0
    for n in nodes:
        bs = n.block_size or 1
        need = math.ceil(prompt_tokens / bs)
        cap = node_capacity_blocks(n)
        room = node_admissible_blocks(n)
        largest_ever = max(largest_ever, cap)
        largest_now = max(largest_now, room)
        if need > cap or (n.max_model_len is not None and prompt_tokens >= n.max_model_len):
            continue
        ever = True
        if need - min(need, matches.get(n.node_id, 0)) <= room:
            now.append(n)
    return Fit(now, ever, largest_now, largest_ever)
