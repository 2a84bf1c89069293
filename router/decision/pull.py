"""The cluster as one cache: a node loads a prefix's KV from the node that holds it instead of
computing it again (pure).

When the node holding a prompt's longest prefix has seconds of prefill queued and another node
has room, the choice used to be between waiting on the holder (a hit) and computing the prefix
again where there is room (a ``spread``: better tail latency, a lower hit rate). A third choice
prices the move: the node with room gets the request and first *pulls* the prefix's KV from
the holder through the engines' KV connector — the holder answers one short request that keeps
the blocks for the transfer (it skips its queue: it computes nothing new), and the KV crosses
the link between the two engines. For Llama-3.1-8B a token's KV is 128 KiB: a 4,000-token
prefix is ~512 MiB, ~40 ms over a 100 Gb/s link, against ~250 ms to compute it on an H100.

The completion-cost policy prices it per node (router/decision/policies/costmodel.py): the prefill
of the tokens the pull brings is replaced by :func:`pull_s` (the holder's answer, then the bytes
over the slower of the two links). Only nodes whose engines say they can give and take KV
(``NodeView.kv_pull``, from their agents' heartbeats) pull or are pulled from; a pull that
fails or times out falls back to computing the prompt where it was sent. The holder need not be
a candidate to run the request: one without room for the rest of a long context still gives
what it holds (``RouteRequest.givers``, set by the pipeline).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from router.decision.disagg import remote_decode_params
from router.decision.types import NodeView
from router.decision.weights import CostWeights

__all__ = ["PullSource", "answering", "priced", "pull_body", "pull_s", "pull_source"]


@dataclass(frozen=True, slots=True)
class PullSource:
    node_id: str
    blocks: int  # leading blocks of the prompt it holds
    link_gbps: float | None  # its KV link (None: the router's default)
    # until it answers: the prompts it is computing go first (an engine schedules its running
    # requests' prefill chunks before a request it takes ahead of its queue)
    wait_s: float = 0.0


def pull_source(nodes: Sequence[NodeView], matches: Mapping[str, int]) -> PullSource | None:
    """The node a pull would read a prompt's prefix from: among the healthy nodes that give
    KV, the one holding the longest prefix (ties: the least queued). None when none holds
    any."""
    best: NodeView | None = None
    depth = 0
    for n in nodes:
        if not n.kv_pull or not n.healthy:
            continue
        got = matches.get(n.node_id, 0)
        tie = got and got == depth and best is not None and n.queue_len < best.queue_len
        if got > depth or tie:
            best, depth = n, got
    if best is None or depth == 0:
        return None
    return PullSource(best.node_id, depth, best.kv_link_gbps)


def pull_s(
    tokens: float,
    kv_bytes_per_token: int,
    link_gbps: float,
    overhead_s: float,
) -> float:
    """Seconds until ``tokens`` tokens of KV have arrived: the holder's answer (``overhead_s``)
    and the bytes over the link."""
    return overhead_s + tokens * kv_bytes_per_token * 8 / (link_gbps * 1e9)


def answering(
    src: PullSource, backlog_tokens: float, waiting_tokens: float, rate: float, skips_queue: bool
) -> PullSource:
    """``src`` with the time until it answers a pull: its prefill queue (this router's prompts
    there without a first token, or its waiting requests' tokens, the larger) at ``rate`` —
    or, when the leg goes ahead of its queue (router.pull_priority), only the prefill it is
    computing now (that backlog less what is still waiting)."""
    if skips_queue:
        ahead = max(0.0, backlog_tokens - waiting_tokens)
    else:
        ahead = max(backlog_tokens, waiting_tokens)
    return replace(src, wait_s=ahead / rate)


def priced(
    prompt_tokens: int,
    n: NodeView,
    hit_tokens: float,
    src: PullSource,
    slowdown: float,
    inv_rate: float,
    w: CostWeights,
    kv_bytes_per_token: int,
    default_link_gbps: float,
) -> tuple[float, float]:
    """The prompt tokens a pull from ``src`` brings to ``n`` (which holds ``hit_tokens`` of the
    prompt) and the seconds until they are there, when that is less than computing them on
    ``n`` as the cost weighs a prefill (``prefill_weight`` + ``slowdown``: the stall and
    congestion terms per second of prefill, at ``inv_rate`` seconds a token); else (0, 0)."""
    gain = min(max(0, prompt_tokens - 1), src.blocks * n.block_size) - hit_tokens
    if gain <= 0:
        return 0.0, 0.0
    links = [g for g in (n.kv_link_gbps, src.link_gbps) if g]
    link = min(links) if links else default_link_gbps
    moved = pull_s(gain, kv_bytes_per_token, link, w.pull_overhead_s) + src.wait_s
    computed = gain * inv_rate * (w.prefill_weight + slowdown)
    return (gain, moved) if moved < computed else (0.0, 0.0)


def pull_body(
    body: Mapping[str, Any], model: str, prefix: Sequence[int], priority: int | None = None
) -> dict[str, Any]:
    """What the holder gets for a pull: the prefix's token ids as a completion of one token,
    not streamed, its KV kept for a remote engine (``do_remote_decode``, vLLM's disaggregated
    flow), with the client's ``cache_salt`` (the prefix's blocks are hashed from it) and
    ``priority`` when one is configured (router.pull_priority)."""
    out: dict[str, Any] = {
        "model": model,
        "prompt": list(prefix),
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": remote_decode_params(),
    }
    if isinstance(body.get("cache_salt"), str):
        out["cache_salt"] = body["cache_salt"]
    if priority is not None:
        out["priority"] = priority
    return out
