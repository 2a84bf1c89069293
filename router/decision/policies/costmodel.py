"""The cost model of kvgate's policy (router/decision/policies/cost.py): the expected completion
cost of a request on a node, in seconds — what the policy prices, not how it chooses.

For a request on a node the model estimates, from that node's performance model (the weights
of router/decision/weights.py; the prefill rate is the one this router observed on the node,
router/decision/inflight.py, once it has seen a few prefills there, else
``prefill_tokens_per_s``):

* ``queue_s`` — prefill already queued there: this router's own dispatches awaiting their first
  token (exact), or the node's waiting requests × the average uncached prompt (other routers);
* ``prefill_s`` — the prefill of the part of the prompt the node does not hold. The cache hit is
  a discount on prefill, not a bonus; a hit counts only as much as the index can be trusted
  (``confidence``: 1 when the index has every KV batch the node's heartbeat announced, decaying
  with the time the index has been behind);
* ``decode_s`` — the request's decode at the node's current step time (batch size and context
  held), over a bounded horizon (the batch changes; far-future TPOT is not predictable);
* ``stall_s`` — the stall its prefill imposes on the decodes already running there (chunked
  prefill shares the step with them), weighted by ``interference``;
* ``congestion_s`` — the delay its prefill imposes on the requests that will queue behind it,
  weighted by ``congestion``: the prefill × the queue of the cluster's least queued node (0
  while any node is free). A hit adds little work where it queues; a copy of a prefix some node
  already holds adds a whole prefill to a cluster with no node free, and every request behind
  it waits for it: near saturation copies cost capacity, misses queue more requests and make
  the next copies look cheaper — the cascade that kept a loaded cluster at half its hit rate.
  A copy of a prefix asked for by more than its holders' share of the traffic (its share of
  this router's recent requests × the nodes > its holders, router/decision/hotprefix.py) is
  discounted by that much: it relieves the holders;
* ``kv_s`` — KV pressure: the request's blocks beyond the node's soft limit (an engine out of
  blocks queues or preempts), counting the growth still ahead of the requests running there
  (this router's remaining decode, router/decision/inflight.py: a node whose running requests will
  soon finish has more room than one whose long generations have far to go);
* ``affinity_s`` — a request with a session key gets a small bonus on the session's home node:
  the node this router sent the session's previous turn to, while it is a candidate and no
  other node holds more of this prompt (the node that holds the conversation; a home kept
  through a short overload, where the load bound of a hash ring would move it and pull the next
  turn away from its context — but a turn that shares more with another node, another bot's
  system prompt, goes by its hits); for a session this
  router has not seen, when no node holds any of its prompt, the node of consistent hashing
  with bounded loads (:mod:`router.decision.affinity`, the same on every router replica; where
  some node holds a prefix, that node's hit decides, not a node the session's hash names). A
  soft preference that load outweighs. After the first turn the prefix hit on the node holding
  the conversation is the stronger pull, and it works across router replicas because it comes
  from the shared index.

A **pull** (router/decision/pull.py) replaces the prefill of the tokens it brings by ``pull_s``:
the holder's answer and the bytes over the link.

Load signals from heartbeats are smoothed (EWMA per node, router/decision/policies/smoothing.py)
so that noisy samples do not make decisions ping-pong; the router's own in-flight work is added
exactly. What the per-node loop reads of a node is read once per view (:meth:`CostModel.terms`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from router.decision.policies.smoothing import LoadSmoother
from router.decision.policies.terms import index_confidence
from router.decision.pull import PullSource, answering, priced, pull_source
from router.decision.types import NodeView, RouteRequest
from router.decision.weights import CostWeights

__all__ = ["CostModel"]


class CostModel:
    """The prices of kvgate's policy, with what they learn: the load smoothed per node, the
    average uncached prompt this router sends (it costs other routers' queued requests)."""

    def __init__(
        self,
        w: CostWeights,
        kv_bytes_per_token: int = 131_072,
        kv_link_gbps: float = 100.0,
        pull_skips_queue: bool = False,
    ) -> None:
        self.w = w
        self.pull_skips_queue = pull_skips_queue  # a pull's leg goes ahead of the holder's queue
        self.kv_bytes_per_token = kv_bytes_per_token  # a pull's bytes (router/decision/pull.py)
        self.kv_link_gbps = kv_link_gbps  # the link of nodes that do not say theirs
        self.avg_uncached = 2048.0  # EWMA of the uncached prompt tokens this router sends
        self.smooth = LoadSmoother()  # heartbeats, smoothed per node
        self._terms_of: dict[str, tuple[NodeView, tuple[float, ...]]] = {}  # terms, per view

    def reweigh(self, w: CostWeights) -> None:
        self.w = w
        self._terms_of.clear()  # the confidence terms depend on the weights

    def sent(self, uncached_tokens: int) -> None:
        """A request went with ``uncached_tokens`` to compute: into the average."""
        self.avg_uncached += self.w.prefill_ewma * (uncached_tokens - self.avg_uncached)

    def saturation(self, nodes: Sequence[NodeView]) -> float:
        """Requests queued on the least queued of ``nodes`` (waiting there, smoothed, and this
        router's own dispatches awaiting their first token): 0 while any node is free."""
        floor = math.inf
        known = self._terms_of
        for n in nodes:
            got = known.get(n.node_id)
            queued = (got[1] if got is not None and got[0] is n else self.terms(n))[5]
            if queued <= 0:
                return 0.0  # a free node: the common case ends the pass at once
            if queued < floor:
                floor = queued
        return 0.0 if floor == math.inf else floor

    def congestion(
        self, request: RouteRequest, nodes: Sequence[NodeView], matches: Mapping[str, int]
    ) -> float:
        """How many queued requests a prefill delays, as :meth:`cost` counts them: the
        cluster's :meth:`saturation`, less the share of it a copy of the request's prefix
        relieves. A prefix asked for by more than its holders' share of the traffic
        (``prefix_share`` × nodes > holders) is worth copying: its holders queue its followers,
        and each copy takes a part of them. Any other copy only adds a prefill to a cluster
        that has no node free: every request behind it waits for it."""
        floor = self.saturation(nodes)
        if not floor or not request.prefix_share:
            return floor
        depth = max(matches.values(), default=0)
        holders = sum(1 for n in nodes if matches.get(n.node_id, 0) >= depth)
        return floor * max(0.0, 1.0 - request.prefix_share * len(nodes) / max(1, holders))

    def cost(
        self,
        request: RouteRequest,
        n: NodeView,
        hit: int,
        floor: float = 0.0,
        src: PullSource | None = None,
    ) -> dict[str, float]:
        """The components of the expected completion cost of ``request`` on ``n`` (seconds);
        ``floor``: the queued requests its prefill delays (:meth:`congestion`); ``src``: the
        node a pull would read the prefix from (:meth:`pull`)."""
        w = self.w
        s = self.smooth.of(n, self.w.load_ewma)
        bs = n.block_size
        conf = index_confidence(n, w.stale_grace_s, w.stale_tau_s)
        hit_tokens = min(max(0, request.prompt_tokens - 1), hit * bs) * conf
        rate = self.rate(n)
        pulled, moved_s = self.pull(request, n, hit_tokens, src, s.running, floor, 1.0 / rate)
        uncached = request.prompt_tokens - hit_tokens - pulled
        prefill_s = uncached / rate
        queued = self.queued_tokens(n)
        batch = s.running + n.pending + 1
        context = s.kv_used * bs + request.prompt_tokens
        tpot_s = w.step_base_s + w.step_per_seq_s * batch + w.step_per_context_token_s * context
        need = math.ceil((request.prompt_tokens + request.max_tokens) / bs) - hit_tokens / bs
        growth = n.decode_backlog_tokens / bs
        after = (s.kv_used + growth + need) / n.kv_blocks_total if n.kv_blocks_total else 1.0
        return {
            "queue_s": queued / rate * request.queue_weight,
            "prefill_s": prefill_s * w.prefill_weight,
            "decode_s": min(request.max_tokens, w.decode_horizon_tokens) * tpot_s,
            "stall_s": prefill_s * s.running * w.interference,
            "congestion_s": prefill_s * floor * w.congestion,
            "kv_s": w.kv_pressure_s * max(0.0, after - w.kv_soft_limit),
            "pull_s": moved_s,
            "confidence": conf,
        }

    def pull(
        self,
        request: RouteRequest,
        n: NodeView,
        hit_tokens: float,
        src: PullSource | None,
        running: float,
        floor: float,
        inv_rate: float,
    ) -> tuple[float, float]:
        """The prompt tokens a pull from ``src`` brings to ``n`` and its seconds, where it
        costs less than computing them there (router/decision/pull.py :func:`priced`)."""
        if src is None or not n.kv_pull or src.node_id == n.node_id:
            return 0.0, 0.0
        w = self.w
        slowdown = running * w.interference + floor * w.congestion
        return priced(
            request.prompt_tokens,
            n,
            hit_tokens,
            src,
            slowdown,
            inv_rate,
            w,
            self.kv_bytes_per_token,
            self.kv_link_gbps,
        )

    def source(self, nodes: Sequence[NodeView], matches: Mapping[str, int]) -> PullSource | None:
        """Where a pull reads the prompt's prefix, with the time until it answers
        (router/decision/pull.py :func:`answering`): the holder's queue as :meth:`cost` counts
        it, or only the prefill it is computing when the leg goes ahead of its queue."""
        src = pull_source(nodes, matches)
        if src is None:
            return None
        view = next(n for n in nodes if n.node_id == src.node_id)
        inv, _, _, _, backlog, queued, *_ = self.terms(view)
        rate = 1.0 / inv if inv else self.w.prefill_tokens_per_s
        waiting = queued * self.avg_uncached
        return answering(src, backlog, waiting, rate, self.pull_skips_queue)

    def pull_for(
        self, request: RouteRequest, n: NodeView, hit: int, src: PullSource | None, floor: float
    ) -> int:
        """The leading blocks of the prompt ``n`` would hold after a pull from ``src`` for
        ``request`` (0: no pull)."""
        parts = self.cost(request, n, hit, floor, src)
        return src.blocks if src is not None and parts["pull_s"] > 0 else 0

    def total(
        self, request: RouteRequest, n: NodeView, hit: int, home: str | None, floor: float = 0.0
    ) -> float:
        return self.scores(request, home, floor, (n,), {n.node_id: hit})[0][0]

    def rate(self, n: NodeView) -> float:
        """``n``'s prefill rate (tokens per second): learned or reported, else configured."""
        return n.prefill_tokens_per_s or self.w.prefill_tokens_per_s

    def queue_s(self, n: NodeView) -> float:
        """The seconds the prefill queued on ``n`` takes (:meth:`queued_tokens` at its rate)."""
        return self.queued_tokens(n) / self.rate(n)

    def prefill_s(self, n: NodeView, tokens: float) -> float:
        """The seconds ``n`` takes to compute ``tokens`` of prompt."""
        return tokens / self.rate(n)

    def queued_tokens(self, n: NodeView) -> float:
        """The prompt tokens queued on ``n`` as ``queue_s`` counts them: this router's own
        prefill backlog there, or the node's waiting requests (every router's, smoothed) × the
        average uncached prompt, whichever is more."""
        known = self._terms_of.get(n.node_id)
        terms = known[1] if known is not None and known[0] is n else self.terms(n)
        waiting = terms[5] * self.avg_uncached
        return terms[4] if terms[4] > waiting else waiting

    def terms(self, n: NodeView) -> tuple[float, ...]:
        """What the per-node loop reads of ``n``, read once per view (the router hands the
        same view object back while nothing of the node moved: InflightLedger.view), with its
        smoothed load: (inverse prefill rate or 0: the configured one, block size, index
        confidence, running, prefill backlog, queued requests, running + pending + 1, cached
        context tokens, KV blocks, KV blocks held and growing)."""
        got = self._terms_of.get(n.node_id)
        if got is not None and got[0] is n:
            return got[1]
        s = self.smooth.of(n, self.w.load_ewma)
        w = self.w
        bs = n.block_size
        learned = n.prefill_tokens_per_s
        conf = index_confidence(n, w.stale_grace_s, w.stale_tau_s) if n.kv_index_gap > 0 else 1.0
        terms = (
            1.0 / learned if learned else 0.0,
            float(bs),
            conf,
            s.running,
            float(n.prefill_backlog_tokens),
            s.waiting + n.pending,
            s.running + n.pending + 1,
            s.kv_used * bs,
            float(n.kv_blocks_total),
            s.kv_used + n.decode_backlog_tokens / bs,
        )
        self._terms_of[n.node_id] = (n, terms)
        return terms

    def scores(
        self,
        request: RouteRequest,
        home: str | None,
        floor: float,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        rot: int = 0,
        src: PullSource | None = None,
    ) -> list[tuple[float, int, int]]:
        """Per node of ``nodes``, (the sum of :meth:`cost`'s components for ``request`` there,
        its place in the tie order rotated by ``rot``, its index) — without building the
        components: the decision's per-node loop, with everything that does not depend on the
        node hoisted and what depends only on the node read once per view (:meth:`terms`)."""
        w = self.w
        known = self._terms_of
        read = self.terms
        mget = matches.get
        prompt = request.prompt_tokens
        last = max(0, prompt - 1)
        default_inv_rate = 1.0 / w.prefill_tokens_per_s
        queue_weight = request.queue_weight
        prefill_weight, interference = w.prefill_weight, w.interference
        congestion = floor * w.congestion
        horizon = min(request.max_tokens, w.decode_horizon_tokens)
        decode_base = horizon * (w.step_base_s + w.step_per_context_token_s * prompt)
        per_seq, per_ctx = horizon * w.step_per_seq_s, horizon * w.step_per_context_token_s
        kv_pressure, kv_soft = w.kv_pressure_s, w.kv_soft_limit
        demand = prompt + request.max_tokens
        avg_uncached = self.avg_uncached
        affinity = w.session_affinity_s
        count = len(nodes)
        out: list[tuple[float, int, int]] = []
        for i, n in enumerate(nodes):
            node = n.node_id
            got = known.get(node)
            terms = got[1] if got is not None and got[0] is n else read(n)
            inv, bs, conf, running, backlog, queued, batch, ctx, blocks, held = terms
            if not inv:
                inv = default_inv_rate
            hit = mget(node, 0)
            hit_tokens = min(last, hit * bs) * conf if hit else 0.0
            waiting_tokens = queued * avg_uncached
            pulled, moved_s = (
                self.pull(request, n, hit_tokens, src, running, floor, inv)
                if src is not None and n.kv_pull
                else (0.0, 0.0)
            )
            total = (
                (backlog if backlog > waiting_tokens else waiting_tokens) * inv * queue_weight
                + (prompt - hit_tokens - pulled)
                * inv
                * (prefill_weight + running * interference + congestion)
                + moved_s
                + decode_base
                + per_seq * batch
                + per_ctx * ctx
            )
            if blocks:
                over = (held - hit_tokens / bs + (-(-demand // bs))) / blocks - kv_soft
                if over > 0:
                    total += kv_pressure * over
            elif kv_soft < 1.0:
                total += kv_pressure * (1.0 - kv_soft)
            if node == home:
                total -= affinity
            out.append((total, (i + rot) % count, i))
        return out
