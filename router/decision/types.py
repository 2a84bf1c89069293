"""The routing core: pure functions over a snapshot of the cluster (no I/O, time passed in).

The live router and the offline replay call the same :class:`Policy` implementations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "Candidate",
    "NodeView",
    "Policy",
    "PolicyBase",
    "RouteDecision",
    "RouteRequest",
    "eligible",
    "simple_candidates",
]


@dataclass(slots=True)  # not frozen: built per node per decision, frozen init is 4× slower
class NodeView:
    """One node as the latest heartbeat described it, plus the router's own pending work.
    Treated as immutable: :meth:`with_router_state` returns a new view."""

    node_id: str
    endpoint: str
    model: str
    pool: str
    block_size: int
    kv_blocks_total: int
    kv_blocks_used: int
    running: int
    waiting: int
    healthy: bool
    draining: bool
    heartbeat_ts: float
    lease_s: float
    slo_attainment: float = 1.0
    pending: int = 0  # this router's dispatches not yet visible in the heartbeat
    prefill_backlog_tokens: int = 0  # this router's uncached prompt tokens awaiting prefill
    kv_index_gap: int = 0  # KV batches the node announced that the index has not applied
    kv_index_age_s: float = 0.0  # since the index last applied a KV batch of this node
    adapters: frozenset[str] = frozenset()  # LoRA adapters it serves besides its model
    dp_rank: int | None = None  # the engine's data-parallel rank this node is
    started_at: float | None = (
        None  # when its engine started (slow start, router/decision/fleet.py)
    )
    labels: frozenset[tuple[str, str]] = frozenset()  # (key, value): zone, GPU type, …
    role: str = (
        "mixed"  # mixed, prefill or decode (disaggregated prefill, router/decision/disagg.py)
    )
    kv_link_gbps: float | None = None  # its KV transfer bandwidth (None: the router's default)
    decode_backlog_tokens: int = 0  # output this router's requests there are still to produce
    long_kv_blocks: int = (
        0  # KV blocks of this router's long requests there (router/decision/lanes.py)
    )
    prefill_tokens_per_s: float = 0.0  # its prefill rate as this router saw it (0: unknown)
    kv_blocks_admissible: int | None = None  # its heartbeat's (None: from total and used)
    max_model_len: int | None = None  # its engine's context limit, if known
    retention_hints: bool = False  # its engine keeps a session's KV when asked (agent_hint)
    kv_pull: bool = False  # its engine gives and takes a prefix's KV (router/decision/pull.py)

    @property
    def engine_headers(self) -> dict[str, str]:
        """Headers that pin a request to this node's engine core (vLLM's DP rank header)."""
        return {} if self.dp_rank is None else {"X-data-parallel-rank": str(self.dp_rank)}

    @property
    def kv_used_ratio(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 1.0

    @property
    def queue_len(self) -> int:
        return self.waiting + self.pending

    def serves(self, model: str) -> bool:
        """A request for ``model`` (the base model or one of its adapters) may run here."""
        return model == self.model or model in self.adapters

    def alive(self, now: float) -> bool:
        return now - self.heartbeat_ts <= self.lease_s

    def with_router_state(
        self,
        pending: int,
        prefill_backlog_tokens: int,
        decode_backlog_tokens: int = 0,
        long_kv_blocks: int = 0,
        prefill_tokens_per_s: float = 0.0,
    ) -> NodeView:
        """This view plus the router's own in-flight work on the node."""
        if (
            pending == self.pending
            and prefill_backlog_tokens == self.prefill_backlog_tokens
            and decode_backlog_tokens == self.decode_backlog_tokens
            and long_kv_blocks == self.long_kv_blocks
            and prefill_tokens_per_s == self.prefill_tokens_per_s
        ):
            return self
        return NodeView(
            self.node_id,
            self.endpoint,
            self.model,
            self.pool,
            self.block_size,
            self.kv_blocks_total,
            self.kv_blocks_used,
            self.running,
            self.waiting,
            self.healthy,
            self.draining,
            self.heartbeat_ts,
            self.lease_s,
            self.slo_attainment,
            pending,
            prefill_backlog_tokens,
            self.kv_index_gap,
            self.kv_index_age_s,
            self.adapters,
            self.dp_rank,
            self.started_at,
            self.labels,
            self.role,
            self.kv_link_gbps,
            decode_backlog_tokens,
            long_kv_blocks,
            prefill_tokens_per_s,
            self.kv_blocks_admissible,
            self.max_model_len,
            self.retention_hints,
            self.kv_pull,
        )


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    model: str
    block_hashes: Sequence[int]
    prompt_tokens: int
    max_tokens: int
    session_id: str | None = None
    queue_weight: float = 1.0  # × the node's queue in the cost (tight SLO classes: > 1)
    # of this router's recent requests, those asking for its longest held prefix
    # (router/decision/hotprefix.py; set by the pipeline's decide())
    prefix_share: float = 0.0
    parent_session_id: str | None = None  # a subagent's: it starts at its parent's home
    # nodes that hold more of its prefix than any candidate but may not run it (no room, over
    # their limits): a pull may still read the prefix from them (router/decision/pull.py; set
    # by the pipeline's decide())
    givers: Sequence[NodeView] = ()


@dataclass(slots=True)  # treated as immutable
class Candidate:
    node_id: str
    score: float
    hit_blocks: int
    hit_fraction: float
    kv_used_ratio: float
    queue_len: int
    healthy: bool
    components: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    chosen: str | None
    reason: str
    candidates: tuple[Candidate, ...]
    prefill: str | None = None  # disaggregated: the node that prefills (``chosen`` decodes)
    # a pull: ``chosen`` loads the first ``pull_blocks`` blocks of the prompt (those it lacks)
    # from this node's KV before it computes the rest
    pull: str | None = None
    pull_blocks: int = 0
    weights_version: int | None = (
        None  # a canary's weights decided it (router/decision/policies/canary.py)
    )

    @property
    def chosen_candidate(self) -> Candidate | None:
        """The chosen node's candidate (its score and cost components), if recorded."""
        return next((c for c in self.candidates if c.node_id == self.chosen), None)


class Policy(Protocol):
    """Every routing policy: same inputs, same output."""

    record_candidates: int  # candidates a decision keeps for its record (the chosen one always)

    @property
    def name(self) -> str: ...

    @property
    def weights_version(self) -> int: ...

    def decide(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        """Where ``request`` would go among ``nodes`` now. Learns nothing: a dry run or a
        decision that is not taken leaves the policy as it was."""
        ...

    def commit(
        self, request: RouteRequest, decision: RouteDecision, uncached_tokens: int, now: float
    ) -> None:
        """``decision`` was taken (the request is sent; ``uncached_tokens`` of its prompt are
        computed there): what the policy learns from it."""
        ...

    def paused(self, session_id: str, node: str, now: float, until: float) -> None:
        """A turn of ``session_id`` ended on ``node``: the session pauses (a tool runs), its
        context worth keeping there until ``until`` (router/decision/turngap.py)."""
        ...

    def resident_tokens(self, now: float) -> dict[str, int]:
        """Per node, the tokens of the resident sessions' contexts the policy counts there
        (router/decision/residency.py; empty for a policy that places no sessions)."""
        ...


class PolicyBase:
    """Shared by every policy: no eligible node → no decision; otherwise ``choose``."""

    name: str = "base"
    weights_version: int = 0
    record_candidates: int = 8

    def decide(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        if not nodes:
            return RouteDecision(None, "no_healthy_node", ())
        return self.choose(request, nodes, matches, now)

    def choose(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        raise NotImplementedError

    def commit(
        self, request: RouteRequest, decision: RouteDecision, uncached_tokens: int, now: float
    ) -> None:
        """Nothing to learn (policies with state of their own override it)."""

    def paused(self, session_id: str, node: str, now: float, until: float) -> None:
        """Nothing to learn (policies that place sessions override it)."""

    def resident_tokens(self, now: float) -> dict[str, int]:
        return {}


def eligible(nodes: Sequence[NodeView], model: str, now: float) -> list[NodeView]:
    """Nodes that serve ``model`` (or have it as an adapter), are healthy, not draining and
    whose lease has not expired."""
    # (NodeView.serves and .alive, inline: a pass over every node of every decision)
    return [
        n
        for n in nodes
        if (n.model == model or model in n.adapters)
        and n.healthy
        and not n.draining
        and now - n.heartbeat_ts <= n.lease_s
    ]


def simple_candidates(
    nodes: Sequence[NodeView],
    matches: Mapping[str, int],
    request: RouteRequest,
    score: Callable[[NodeView], float],
) -> tuple[Candidate, ...]:
    """The candidates of a policy without cost components: each node's ``score`` and hit."""
    total = max(1, len(request.block_hashes))
    return tuple(
        Candidate(
            n.node_id,
            score(n),
            matches.get(n.node_id, 0),
            matches.get(n.node_id, 0) / total,
            n.kv_used_ratio,
            n.queue_len,
            n.healthy,
        )
        for n in nodes
    )
