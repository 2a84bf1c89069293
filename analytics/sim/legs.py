"""A routed request reaching its engines in the simulator, for a
:class:`~analytics.sim.cluster.SimCluster`: straight to its node, or in two legs whose KV crosses
the link between two engines —

* **disaggregated prefill** (``RouteDecision.prefill``): the prefill node computes the prompt
  (one token), its KV moves to the decode node, which decodes from it;
* **a pull** (``RouteDecision.pull``, router/decision/pull.py): the node holding the prefix
  answers a one-token request for it — in its queue, or ahead of it with
  ``router.pull_priority`` (vLLM's priority scheduling; ``SimConfig.pull_first``) — computing
  nothing new while it still holds the blocks; the prefix's KV moves to the chosen
  node, which computes the rest of the prompt. Blocks the chosen node has no room for are not
  received (it computes them: the fallback of a failed transfer), and the blocks it receives
  are stored in its cache and announced as KV events like any it computed.

The transfer takes the bytes over ``SimConfig.kv_link_gbps``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from analytics.sim.enginesteps import cut_run
from analytics.sim.simcore import SimSeq
from analytics.sim.simnode import SimNode, all_hashes
from router.decision.types import RouteDecision

if TYPE_CHECKING:
    from analytics.sim.cluster import SimCluster

__all__ = ["leg_done", "on_kv", "send"]


def send(
    sim: SimCluster,
    idx: int,
    seq: SimSeq,
    d: RouteDecision,
    matches: Mapping[str, int],
    now: float,
) -> None:
    """Request ``idx`` (its engine request ``seq``) goes where ``d`` says (``matches``: the
    blocks of its prompt each node holds, as the router saw them)."""
    target = sim.by_id[cast(str, d.chosen)]
    rid = seq.request_id
    r = sim.requests[idx]
    bs = sim.trace.block_size
    if d.prefill is not None:  # the prompt is computed on the prefill node first
        pre = sim.by_id[d.prefill]
        pid = f"{rid}/p"
        hit = matches.get(pre.node_id, 0) * bs
        sim.ledger.dispatch(pid, pre.node_id, now, max(0, r.prompt_tokens - hit))
        sim.split[pid] = (idx, target.node_id, seq, 0)
        sim.add(pre, SimSeq(pid, r.prompt_tokens, 1, all_hashes(r, idx, bs)), now)
    elif d.pull is not None and d.pull_blocks > 0:  # the prefix's KV comes from its holder
        src = sim.by_id[d.pull]
        pid = f"{rid}/k"
        blocks = d.pull_blocks
        sim.ledger.dispatch(pid, src.node_id, now, 0)
        sim.split[pid] = (idx, target.node_id, seq, blocks)
        sim.stats["kv_pulls"] = sim.stats.get("kv_pulls", 0) + 1
        leg = SimSeq(pid, blocks * bs, 1, list(r.block_hashes[:blocks]))
        sim.add(src, leg, now, first=sim.cfg.pull_first)
    else:
        sim.add(target, seq, now)
        sim.preemption.sent(idx, seq, target.node_id, now)


def leg_done(sim: SimCluster, seq: SimSeq, now: float) -> bool:
    """``seq`` finished on its node: when it was a first leg, its KV sets off for the second
    leg's node (True); False for any other request."""
    got = sim.split.pop(seq.request_id, None)
    if got is None:
        return False
    idx, dnode, dseq, blocks = got
    sim.ledger.finish(seq.request_id)
    tokens = blocks * sim.trace.block_size if blocks else sim.requests[idx].prompt_tokens
    moved = tokens * sim.profile.kv_bytes_per_token * 8 / (sim.cfg.kv_link_gbps * 1e9)
    sim.push(now + moved, "kv", (dnode, dseq, seq.cached_tokens, blocks))
    return True


def on_kv(sim: SimCluster, now: float, data: object) -> None:
    """A first leg's KV arrived at the second leg's node: the decode node decodes from it; a
    puller computes the rest of the prompt."""
    dnode, dseq, reused, blocks = cast(tuple[str, SimSeq, int, int], data)
    n: SimNode = sim.by_id[dnode]
    r = sim.requests[int(dseq.request_id[1:])]
    cut_run(sim, n, now)
    if blocks:  # a pull: the prefix's blocks this node lacks
        have = n.core.cache.match_prefix(r.block_hashes[:blocks])
        parent = r.block_hashes[have - 1] if have else None
        got = n.core.receive(list(r.block_hashes[have:blocks]), parent)
        sim.stats["kv_pulled_blocks"] = sim.stats.get("kv_pulled_blocks", 0) + got
        sim.add(n, dseq, now)
        sim.preemption.sent(int(dseq.request_id[1:]), dseq, dnode, now)
        return
    n.core.receive(list(r.block_hashes)[: max(0, (r.prompt_tokens - 1) // sim.trace.block_size)])
    sim.prefill_reuse[dseq.request_id] = reused  # the prefix cache's share: the prefill's
    sim.add(n, dseq, now)
