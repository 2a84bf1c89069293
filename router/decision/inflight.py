"""The router's own in-flight requests, per node: what heartbeats cannot show it yet.

* **Unreflected dispatches.** Between two heartbeats (~500 ms) a router that trusts the table
  alone sends a whole burst to the same "least loaded" node. A dispatch counts until a heartbeat
  newer than it arrives (the engine has seen the request) or the request finishes.
* **Prefill backlog.** Heartbeats count requests, not how long their prompts are. Until its first
  token comes back, a request's uncached prompt is prefill work still ahead of the node.
* **Remaining decode.** A request's expected output (``max_tokens`` capped by what its tenant's
  answers have been) minus what it has produced since its first token, at the node's observed
  time per output token (learned from this router's finished requests there): the decode, and
  the KV growth, still ahead of the node. A request that ends early stops counting.
* **Prefill rate.** A streamed request's first token comes back once the node prefilled the
  backlog this router had queued there before it and its own uncached prompt: that work over
  the time it took is a sample of the node's prefill rate (work under ``PREFILL_MIN_WORK``
  tokens is dominated by the decode step and the network, and teaches nothing). Learned per
  node and used as the mean over the nodes of a model, so the cost of a miss is in the engines'
  real seconds: engines 10× slower than the configured ``cost.prefill_tokens_per_s`` make misses
  10× costlier, and a router that kept the configured rate would spread prompts onto nodes that
  must prefill them. Until a node of the model has taught it (``PREFILL_MIN_SAMPLES``), the rate
  its agent measured on the idle engine (the heartbeat's ``prefill_tokens_per_s``,
  agents/probe.py), again the mean over the model's nodes that reported one.
* **Long requests' KV** (router/decision/lanes.py): the blocks (prompt + expected output) of the
  long requests in flight on each node.
* **Pending prefixes** (``pending``: :class:`~router.decision.recent.PendingPrefixes`): the
  prompts whose prefill is still running, as hits on their node until their first token.
* **Active blocks** (``track_blocks``; the ``dynamo_cost`` baseline): the distinct prompt blocks
  of the requests in flight on each node, a block shared by several counted once — NVIDIA
  Dynamo's active-sequence accounting with its defaults (``router_assume_kv_reuse`` on,
  ``router_track_output_blocks`` off).

Entries leave on ``finish`` (always called, whatever the outcome) or after ``horizon_s``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.decision.ledgerrecords import LedgerEntry, NodeRecord, RatePool
from router.decision.recent import PendingPrefixes

if TYPE_CHECKING:
    from router.decision.types import NodeView

__all__ = ["InflightLedger"]


DECODE_GRAIN = 16  # tokens: the decode backlog a view carries, in whole KV blocks
TPOT_PRIOR_S = 0.03  # a node's time per output token until one of its requests finished
TPOT_EWMA = 0.1
PREFILL_MIN_WORK = 512  # prompt tokens (own + queued ahead) for a prefill-rate sample
PREFILL_MIN_SAMPLES = 3  # before a node's learned prefill rate counts
PREFILL_EWMA = 0.2


@dataclass(slots=True)
class InflightLedger:
    horizon_s: float = 600.0
    track_blocks: bool = False
    pending: PendingPrefixes | None = None  # prompts being prefilled count as hits there
    _entries: dict[str, LedgerEntry] = field(default_factory=dict)
    _nodes: dict[str, NodeRecord] = field(default_factory=dict)
    _pools: dict[str, RatePool] = field(default_factory=dict)  # group -> its learned rates
    # node -> (the view it was given, what its state was read at, the view returned): view()
    _views: dict[str, tuple[NodeView, tuple[int, int, float, int], NodeView]] = field(
        default_factory=dict
    )

    def __len__(self) -> int:
        return len(self._entries)

    def _node(self, node: str) -> NodeRecord:
        n = self._nodes.get(node)
        if n is None:
            n = self._nodes[node] = NodeRecord(node, self._pool(""))
        return n

    def _pool(self, group: str) -> RatePool:
        pool = self._pools.get(group)
        if pool is None:
            pool = self._pools[group] = RatePool()
        return pool

    def _regroup(self, n: NodeRecord, group: str) -> None:
        """``n`` serves ``group`` (its model) now: its learned rate counts in that pool."""
        reported = n.reported_rate
        self._report(n, 0.0)
        if n.prefill_samples >= PREFILL_MIN_SAMPLES:
            n.pool.known -= 1
            n.pool.rates -= n.prefill_rate
        n.pool.version += 1
        n.group, n.pool = group, self._pool(group)
        if n.prefill_samples >= PREFILL_MIN_SAMPLES:
            n.pool.known += 1
            n.pool.rates += n.prefill_rate
        n.pool.version += 1
        n.version += 1
        self._report(n, reported)

    @staticmethod
    def _report(n: NodeRecord, rate: float) -> None:
        """``n``'s agent reports ``rate`` (0: none) now."""
        pool = n.pool
        if n.reported_rate:
            pool.reporting -= 1
            pool.reported -= n.reported_rate
        if rate:
            pool.reporting += 1
            pool.reported += rate
        n.reported_rate = rate
        pool.version += 1
        n.version += 1

    def dispatch(
        self,
        request_id: str,
        node: str,
        now: float,
        prefill_tokens: int,
        expected_output: int = 0,
        long_blocks: int = 0,
        hashes: Sequence[int] = (),
    ) -> None:
        """``expected_output``: the decode it is expected to do; ``long_blocks``: its KV blocks
        when it is a long request (router/decision/lanes.py), else 0; ``hashes``: its prompt blocks
        (kept with ``track_blocks``)."""
        prev = self._entries.get(request_id)
        self.finish(request_id)  # a re-dispatch replaces the entry
        n = self._node(node)
        kept = tuple(hashes) if self.track_blocks else ()
        self._entries[request_id] = LedgerEntry(
            n,
            now,
            prefill_tokens,
            expected_output=expected_output,
            long_blocks=long_blocks,
            hashes=kept,
            pending=self.pending.add(node, hashes) if self.pending is not None else (),
            ahead=n.backlog,
        )
        if kept:
            if n.blocks is None:
                n.blocks = Counter()
            n.blocks.update(kept)
        if prev is None or prev.node is not n:  # counted once among the unreflected
            n.recent.append((now, request_id))
        n.count += 1
        n.backlog += prefill_tokens
        n.long_blocks += long_blocks
        n.expected += expected_output
        n.version += 1

    def moved(self, request_id: str, node: str, now: float) -> None:
        """The request runs on ``node`` after all (a gateway's fallback): re-dispatched there,
        as it was counted (its prompt's prefill, its expected decode), from ``now``."""
        e = self._entries.get(request_id)
        if e is None or e.node.name == node:
            return
        self.dispatch(
            request_id,
            node,
            now,
            e.prefill_tokens,
            e.expected_output,
            e.long_blocks,
            e.hashes,
        )

    def first_token(self, request_id: str, now: float | None = None, learn: bool = True) -> None:
        """The request's first token came back at ``now``. ``learn``: it came as soon as the
        node produced it (a streamed answer), so it teaches the node's prefill rate."""
        e = self._entries.get(request_id)
        if e is None or not e.prefilling:
            return
        e.prefilling = False
        n = e.node
        n.backlog -= e.prefill_tokens
        n.version += 1
        if e.pending and self.pending is not None:
            self.pending.remove(n.name, e.pending)
            e.pending = ()
        work = e.ahead + e.prefill_tokens
        if (
            learn
            and now is not None
            and work >= PREFILL_MIN_WORK
            and 2 * e.prefill_tokens >= PREFILL_MIN_WORK
            and now > e.dispatched_s
        ):
            seen = min(1e8, work / (now - e.dispatched_s))
            old = n.prefill_rate if n.prefill_samples else seen
            n.prefill_rate = new = old + PREFILL_EWMA * (seen - old)
            n.prefill_samples += 1
            n.pool.version += 1
            if n.prefill_samples == PREFILL_MIN_SAMPLES:
                n.pool.known += 1
                n.pool.rates += new
            elif n.prefill_samples > PREFILL_MIN_SAMPLES:
                n.pool.rates += new - old
        if now is not None and e.expected_output > 1:
            e.first_token_s = now
            n.decoding += 1
            n.first_sum += now

    def finish(
        self, request_id: str, now: float | None = None, output_tokens: int | None = None
    ) -> None:
        """The request is over (whatever the outcome). With ``now`` and the ``output_tokens``
        it produced, its time per output token teaches the node's."""
        self.first_token(request_id)
        e = self._entries.pop(request_id, None)
        if e is None:
            return
        n = e.node
        n.count -= 1
        n.long_blocks -= e.long_blocks
        n.version += 1
        if e.hashes and n.blocks is not None:
            held = n.blocks
            held.subtract(e.hashes)
            for h in e.hashes:
                if h in held and held[h] <= 0:
                    del held[h]
        n.expected -= e.expected_output
        if e.first_token_s is not None:
            n.decoding -= 1
            n.first_sum -= e.first_token_s
            if now is not None and output_tokens is not None and output_tokens > 1:
                seen = (now - e.first_token_s) / (output_tokens - 1)
                old = seen if n.tpot is None else n.tpot
                n.tpot = old + TPOT_EWMA * (seen - old)

    def active_blocks(self, node: str) -> int:
        """Distinct prompt blocks of this router's requests on ``node`` (with track_blocks)."""
        n = self._nodes.get(node)
        return len(n.blocks) if n is not None and n.blocks else 0

    def active_requests(self, node: str) -> int:
        """This router's requests in flight on ``node``."""
        n = self._nodes.get(node)
        return n.count if n is not None else 0

    def active_overlap(self, node: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` are active on ``node`` (with track_blocks)."""
        n = self._nodes.get(node)
        held = n.blocks if n is not None else None
        return sum(1 for h in hashes if h in held) if held else 0

    def long_blocks(self, node: str) -> int:
        """KV blocks of this router's long requests on ``node``."""
        n = self._nodes.get(node)
        return n.long_blocks if n is not None else 0

    def prefill_rate(self, node: str) -> float:
        """The prefill rate the cost of ``node``'s prompts is counted at, in prompt tokens per
        second as this router observed it (0: not known yet): the mean of the learned rates of
        the nodes of its group (its model, as :meth:`router_state` was told). A per-node rate
        gave each of a fleet of equal engines an arbitrary, drifting edge that the cost model
        followed (measured: Mooncake TTFT p99 2.3 → 7.1 s in the routing benchmark); engines of
        another speed serve another model or pool."""
        n = self._nodes.get(node)
        pool = n.pool if n is not None else self._pools.get("")
        return pool.rate() if pool is not None else 0.0

    def node_prefill_rate(self, node: str) -> float:
        """``node``'s own learned prefill rate (0: fewer than PREFILL_MIN_SAMPLES samples)."""
        n = self._nodes.get(node)
        if n is None or n.prefill_samples < PREFILL_MIN_SAMPLES:
            return 0.0
        return n.prefill_rate

    def tpot_s(self, node: str) -> float:
        """``node``'s observed time per output token."""
        n = self._nodes.get(node)
        return TPOT_PRIOR_S if n is None or n.tpot is None else n.tpot

    @staticmethod
    def _remaining(n: NodeRecord, now: float) -> int:
        """The output tokens ``n``'s requests are still expected to produce at ``now``."""
        remaining, k = n.expected, n.decoding
        if remaining and k:
            tpot = TPOT_PRIOR_S if n.tpot is None else n.tpot
            remaining = int(remaining - (k + (k * now - n.first_sum) / tpot))
            if remaining < 0:
                remaining = 0
        return remaining

    def _state(
        self, n: NodeRecord, heartbeat_ts: float, now: float
    ) -> tuple[int, int, int, int, float]:
        """:meth:`router_state` of a node's record (the one implementation)."""
        pending = 0
        q = n.recent
        if q:
            while q and q[0][0] <= heartbeat_ts:
                q.popleft()
            if q:
                entries = self._entries
                for _, rid in q:
                    if rid in entries:
                        pending += 1
        remaining = self._remaining(n, now)
        pool = n.pool  # RatePool.rate(), inline: the decision's per-node loop
        if pool.known:
            rate = pool.rates / pool.known
        else:
            rate = pool.reported / pool.reporting if pool.reporting else 0.0
        return pending, n.backlog, remaining, n.long_blocks, rate

    def remaining_decode(self, node: str, now: float) -> int:
        """Output tokens this router's requests on ``node`` are still expected to produce:
        their expected outputs, less what the decoding ones produced at the node's observed
        time per output token (an estimate: a request past its expected output lowers it)."""
        n = self._nodes.get(node)
        return self._state(n, -math.inf, now)[2] if n is not None else 0

    def unreflected(self, node: str, heartbeat_ts: float) -> int:
        """This router's requests on ``node`` dispatched after its last heartbeat."""
        n = self._nodes.get(node)
        return self._state(n, heartbeat_ts, 0.0)[0] if n is not None else 0

    def router_state(
        self, node: str, heartbeat_ts: float, now: float, group: str = "", reported: float = 0.0
    ) -> tuple[int, int, int, int, float]:
        """What :meth:`router.decision.types.NodeView.with_router_state` takes, in one pass (the
        decision's per-node loop): :meth:`unreflected`, :meth:`prefill_backlog`,
        :meth:`remaining_decode`, :meth:`long_blocks`, :meth:`prefill_rate` (``group``: the
        node's model, whose nodes share a prefill rate; ``reported``: the rate its agent
        measured, 0 when none)."""
        return self._state(self._node_for(node, group, reported), heartbeat_ts, now)

    def _node_for(self, node: str, group: str, reported: float) -> NodeRecord:
        """``node``'s record, in ``group``'s pool, with ``reported`` as its agent's rate."""
        n = self._nodes.get(node)
        if n is None:
            n = self._nodes[node] = NodeRecord(node, self._pool(group), group)
        elif n.group != group:
            self._regroup(n, group)
        if reported != n.reported_rate:
            self._report(n, reported)
        return n

    def view(
        self,
        v: NodeView,
        heartbeat_ts: float,
        now: float,
        group: str = "",
        reported: float = 0.0,
    ) -> NodeView:
        """``v`` with this router's in-flight work on its node (:meth:`router_state`, the
        decode backlog in whole KV blocks of :data:`DECODE_GRAIN` tokens, the grain the cost
        model counts it in). The decision's per-node loop: while nothing it reads has moved —
        the node's requests, its group's prefill rate, the heartbeat, that backlog — the view
        returned last time comes back as it is, not built again."""
        node = v.node_id
        n = self._nodes.get(node)
        if n is None or n.group != group or reported != n.reported_rate:
            n = self._node_for(node, group, reported)
        remaining = self._remaining(n, now)
        remaining -= remaining % DECODE_GRAIN
        key = (n.version, n.pool.version, heartbeat_ts, remaining)
        cached = self._views.get(node)
        if cached is not None and cached[0] is v and cached[1] == key:
            return cached[2]
        pending, backlog, _, long_blocks, rate = self._state(n, heartbeat_ts, now)
        out = v.with_router_state(pending, backlog, remaining, long_blocks, rate)
        self._views[node] = (v, key, out)
        return out

    def prefilling(self, request_id: str) -> int:
        """The prompt tokens ``request_id``'s node still computes before its first token (0
        once it came, or when the ledger does not hold it)."""
        e = self._entries.get(request_id)
        return e.prefill_tokens if e is not None and e.prefilling else 0

    def prefill_backlog(self, node: str) -> int:
        """Uncached prompt tokens of this router's requests on ``node`` still awaiting prefill."""
        n = self._nodes.get(node)
        return n.backlog if n is not None else 0

    def sweep(self, now: float) -> int:
        """Drop entries older than the horizon (a lost ``finish`` must not grow the ledger)."""
        old = [rid for rid, e in self._entries.items() if now - e.dispatched_s > self.horizon_s]
        for rid in old:
            self.finish(rid)
        for n in self._nodes.values():
            q = n.recent
            while q and now - q[0][0] > self.horizon_s:
                q.popleft()
                n.version += 1
        return len(old)
