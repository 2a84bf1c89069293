"""A cluster of simulated engines in virtual time, routed by kvgate's routing core.

Each node is an :class:`agents.scheduler.EngineCore` — the same cache and timing model as the live
simulated engine. The router sees what the live router would: heartbeats every
``heartbeat_interval_s`` and KV-cache changes ``index_lag_s`` late, plus its own dispatches that
the heartbeats do not show yet (:class:`router.ledger.InflightLedger`). Every request is routed
by a :class:`router.core.Policy`, the same objects the live router uses.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import cast

from agents.kvcache import AllCleared, BlockRemoved, BlockStored
from agents.profile import EngineProfile
from agents.scheduler import EngineCore, Sequence, StepResult
from analytics.sim.traces import Trace, TraceRequest
from router.core import NodeView, Policy, RouteRequest, eligible
from router.ledger import InflightLedger
from streams.prefix_index import PrefixIndex

__all__ = ["Done", "SimConfig", "simulate"]

MODEL = "sim"


@dataclass(frozen=True, slots=True)
class SimConfig:
    nodes: int = 16
    profile: EngineProfile = field(default_factory=EngineProfile)
    heartbeat_interval_s: float = 0.5
    index_lag_s: float = 0.15  # agent flush (100 ms) + Kafka + fold
    seed: int = 0


@dataclass(slots=True)
class Done:
    """One finished request."""

    request: TraceRequest
    node: str
    reason: str
    hit_blocks_seen: int  # what the router believed the node had
    cached_tokens: int  # what the engine actually reused
    first_token_s: float
    finish_s: float


@dataclass(slots=True)
class _Node:
    node_id: str
    core: EngineCore
    busy: bool = False
    stepping: list[Sequence] = field(default_factory=list)
    view: NodeView | None = None  # the last heartbeat the router has
    served: int = 0


def _view(n: _Node, now: float, lease_s: float) -> NodeView:
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
        draining=False,
        heartbeat_ts=now,
        lease_s=lease_s,
    )


def simulate(trace: Trace, policy: Policy, cfg: SimConfig) -> list[Done]:
    """Replay ``trace`` through ``policy`` on ``cfg.nodes`` engines; returns finished requests."""
    profile = (
        cfg.profile.model_copy(update={"block_size": trace.block_size})
        if trace.block_size != cfg.profile.block_size
        else cfg.profile
    )
    # keep the KV memory of the profile whatever the block size
    if trace.block_size != cfg.profile.block_size and cfg.profile.num_gpu_blocks_override is None:
        profile = profile.model_copy(
            update={
                "num_gpu_blocks_override": max(
                    1, cfg.profile.num_gpu_blocks * cfg.profile.block_size // trace.block_size
                )
            }
        )
    nodes = [_Node(f"node-{i:02d}", EngineCore(profile)) for i in range(cfg.nodes)]
    by_id = {n.node_id: n for n in nodes}
    index = PrefixIndex()
    ledger = InflightLedger()
    rng = random.Random(cfg.seed)
    lease = cfg.heartbeat_interval_s * 4
    events: list[tuple[float, int, str, object]] = []
    tie = itertools.count()
    lagged: deque[tuple[float, str, object]] = deque()  # (visible at, node, cache event)
    meta: dict[str, tuple[TraceRequest, str, str, int]] = {}
    done: list[Done] = []

    def push(t: float, kind: str, data: object) -> None:
        heapq.heappush(events, (t, next(tie), kind, data))

    t_start = trace.requests[0].arrival_s if trace.requests else 0.0
    push(t_start, "heartbeat", None)  # before the first arrival: routers start with a view
    for i, r in enumerate(trace.requests):
        push(r.arrival_s, "arrive", i)

    def start_step(n: _Node, now: float) -> None:
        res = n.core.step(now)
        n.busy = True
        for ev in n.core.drain_events():
            lagged.append((now + cfg.index_lag_s, n.node_id, ev))
        push(now + res.duration_s, "step", (n.node_id, res))

    remaining = len(trace.requests)
    while events and (remaining > 0):
        now, _, kind, data = heapq.heappop(events)
        while lagged and lagged[0][0] <= now:
            _, node_id, ev = lagged.popleft()
            if isinstance(ev, BlockStored):
                index.add_many(node_id, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    index.remove(node_id, h)
            elif isinstance(ev, AllCleared):
                index.drop_node(node_id)
        if kind == "heartbeat":
            for n in nodes:
                n.view = _view(n, now, lease)
            push(now + cfg.heartbeat_interval_s, "heartbeat", None)
        elif kind == "arrive":
            idx = data
            assert isinstance(idx, int)
            r = trace.requests[idx]
            rid = f"r{idx}"
            views = [
                replace(
                    n.view,
                    pending=ledger.unreflected(n.node_id, n.view.heartbeat_ts),
                    prefill_backlog_tokens=ledger.prefill_backlog(n.node_id),
                )
                for n in nodes
                if n.view is not None
            ]
            req = RouteRequest(
                rid, MODEL, r.block_hashes, r.prompt_tokens, r.output_tokens, r.session_id
            )
            matches = index.match(r.block_hashes)
            d = policy.decide(req, eligible(views, MODEL, now), matches, now)
            target = by_id[d.chosen] if d.chosen is not None else rng.choice(nodes)
            seen = matches.get(target.node_id, 0)
            ledger.dispatch(
                rid, target.node_id, now, max(0, r.prompt_tokens - seen * trace.block_size)
            )
            seq = Sequence(
                rid,
                [0] * r.prompt_tokens,
                r.output_tokens,
                now,
                random.Random(idx),
                prompt_hashes=list(r.block_hashes),
            )
            meta[rid] = (r, target.node_id, d.reason, matches.get(target.node_id, 0))
            target.core.add(seq)
            if not target.busy:
                start_step(target, now)
        else:  # a step finished
            node_id, res = cast(tuple[str, StepResult], data)
            n = by_id[node_id]
            n.busy = False
            for seq, _ in res.tokens:
                if len(seq.output) == 1:
                    ledger.first_token(seq.request_id)
            for seq in res.finished:
                r, node, reason, seen = meta.pop(seq.request_id)
                ledger.finish(seq.request_id)
                n.served += 1
                done.append(
                    Done(
                        r,
                        node,
                        reason,
                        seen,
                        seq.cached_tokens,
                        seq.first_token_s if seq.first_token_s is not None else now,
                        now,
                    )
                )
                remaining -= 1
            if not n.core.idle:
                start_step(n, now)
    return done
