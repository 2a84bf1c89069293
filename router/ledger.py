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
  must prefill them.
* **Long requests' KV** (router/lanes.py): the blocks (prompt + expected output) of the long
  requests in flight on each node.
* **Active blocks** (``track_blocks``; the ``dynamo_cost`` baseline): the distinct prompt blocks
  of the requests in flight on each node, a block shared by several counted once — NVIDIA
  Dynamo's active-sequence accounting with its defaults (``router_assume_kv_reuse`` on,
  ``router_track_output_blocks`` off).

Entries leave on ``finish`` (always called, whatever the outcome) or after ``horizon_s``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["InflightLedger"]


TPOT_PRIOR_S = 0.03  # a node's time per output token until one of its requests finished
TPOT_EWMA = 0.1
PREFILL_MIN_WORK = 512  # prompt tokens (own + queued ahead) for a prefill-rate sample
PREFILL_MIN_SAMPLES = 3  # before a node's learned prefill rate counts
PREFILL_EWMA = 0.2


@dataclass(slots=True)
class _Entry:
    node: str
    dispatched_s: float
    prefill_tokens: int
    prefilling: bool = True
    expected_output: int = 0
    long_blocks: int = 0
    first_token_s: float | None = None
    hashes: tuple[int, ...] = ()  # its prompt blocks (with track_blocks)
    ahead: int = 0  # this router's prefill backlog on the node when it was dispatched


@dataclass(slots=True)
class InflightLedger:
    horizon_s: float = 600.0
    track_blocks: bool = False
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _recent: dict[str, deque[tuple[float, str]]] = field(default_factory=dict)
    _backlog: dict[str, int] = field(default_factory=dict)
    _long_blocks: dict[str, int] = field(default_factory=dict)
    _tpot: dict[str, float] = field(default_factory=dict)  # node -> observed s per output token
    _prefill_rate: dict[str, float] = field(default_factory=dict)  # node -> prompt tokens/s
    _prefill_samples: Counter[str] = field(default_factory=Counter)
    # per group of nodes (their model): nodes with a learned prefill rate, the sum of the rates
    _group: dict[str, str] = field(default_factory=dict)
    _rates_known: Counter[str] = field(default_factory=Counter)
    _rates_sum: dict[str, float] = field(default_factory=dict)
    # per node: expected output of every request in flight; decoding requests and the sum of
    # their first-token times (the decode they did so far is (count · now − sum) / tpot)
    _expected: dict[str, int] = field(default_factory=dict)
    _decoding: dict[str, int] = field(default_factory=dict)
    _first_sum: dict[str, float] = field(default_factory=dict)
    _blocks: dict[str, Counter[int]] = field(default_factory=dict)  # node -> block -> holders
    _count: Counter[str] = field(default_factory=Counter)  # node -> requests in flight

    def __len__(self) -> int:
        return len(self._entries)

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
        when it is a long request (router/lanes.py), else 0; ``hashes``: its prompt blocks
        (kept with ``track_blocks``)."""
        prev = self._entries.get(request_id)
        self.finish(request_id)  # a re-dispatch replaces the entry
        kept = tuple(hashes) if self.track_blocks else ()
        self._entries[request_id] = _Entry(
            node,
            now,
            prefill_tokens,
            expected_output=expected_output,
            long_blocks=long_blocks,
            hashes=kept,
            ahead=self._backlog.get(node, 0),
        )
        if kept:
            self._blocks.setdefault(node, Counter()).update(kept)
        if prev is None or prev.node != node:  # counted once among the unreflected
            self._recent.setdefault(node, deque()).append((now, request_id))
        self._count[node] += 1
        self._backlog[node] = self._backlog.get(node, 0) + prefill_tokens
        if long_blocks:
            self._long_blocks[node] = self._long_blocks.get(node, 0) + long_blocks
        if expected_output:
            self._expected[node] = self._expected.get(node, 0) + expected_output

    def first_token(self, request_id: str, now: float | None = None, learn: bool = True) -> None:
        """The request's first token came back at ``now``. ``learn``: it came as soon as the
        node produced it (a streamed answer), so it teaches the node's prefill rate."""
        e = self._entries.get(request_id)
        if e is not None and e.prefilling:
            e.prefilling = False
            self._backlog[e.node] -= e.prefill_tokens
            work = e.ahead + e.prefill_tokens
            if (
                learn
                and now is not None
                and work >= PREFILL_MIN_WORK
                and 2 * e.prefill_tokens >= PREFILL_MIN_WORK
                and now > e.dispatched_s
            ):
                seen = min(1e8, work / (now - e.dispatched_s))
                old = self._prefill_rate.get(e.node, seen)
                new = old + PREFILL_EWMA * (seen - old)
                self._prefill_rate[e.node] = new
                self._prefill_samples[e.node] += 1
                group = self._group.get(e.node, "")
                if self._prefill_samples[e.node] == PREFILL_MIN_SAMPLES:
                    self._rates_known[group] += 1
                    self._rates_sum[group] = self._rates_sum.get(group, 0.0) + new
                elif self._prefill_samples[e.node] > PREFILL_MIN_SAMPLES:
                    self._rates_sum[group] += new - old
            if now is not None and e.expected_output > 1:
                e.first_token_s = now
                self._decoding[e.node] = self._decoding.get(e.node, 0) + 1
                self._first_sum[e.node] = self._first_sum.get(e.node, 0.0) + now

    def finish(
        self, request_id: str, now: float | None = None, output_tokens: int | None = None
    ) -> None:
        """The request is over (whatever the outcome). With ``now`` and the ``output_tokens``
        it produced, its time per output token teaches the node's."""
        self.first_token(request_id)
        e = self._entries.pop(request_id, None)
        if e is None:
            return
        self._count[e.node] -= 1
        if e.long_blocks:
            self._long_blocks[e.node] -= e.long_blocks
        if e.hashes:
            held = self._blocks[e.node]
            held.subtract(e.hashes)
            for h in e.hashes:
                if h in held and held[h] <= 0:
                    del held[h]
        if e.expected_output:
            self._expected[e.node] -= e.expected_output
        if e.first_token_s is not None:
            self._decoding[e.node] -= 1
            self._first_sum[e.node] -= e.first_token_s
            if now is not None and output_tokens is not None and output_tokens > 1:
                seen = (now - e.first_token_s) / (output_tokens - 1)
                old = self._tpot.get(e.node, seen)
                self._tpot[e.node] = old + TPOT_EWMA * (seen - old)

    def active_blocks(self, node: str) -> int:
        """Distinct prompt blocks of this router's requests on ``node`` (with track_blocks)."""
        held = self._blocks.get(node)
        return len(held) if held else 0

    def active_requests(self, node: str) -> int:
        """This router's requests in flight on ``node``."""
        return self._count[node]

    def active_overlap(self, node: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` are active on ``node`` (with track_blocks)."""
        held = self._blocks.get(node)
        return sum(1 for h in hashes if h in held) if held else 0

    def long_blocks(self, node: str) -> int:
        """KV blocks of this router's long requests on ``node``."""
        return self._long_blocks.get(node, 0)

    def prefill_rate(self, node: str) -> float:
        """The prefill rate the cost of ``node``'s prompts is counted at, in prompt tokens per
        second as this router observed it (0: not known yet): the mean of the learned rates of
        the nodes of its group (its model, as :meth:`router_state` was told). A per-node rate
        gave each of a fleet of equal engines an arbitrary, drifting edge that the cost model
        followed (measured: Mooncake TTFT p99 2.3 → 7.1 s in the routing benchmark); engines of
        another speed serve another model or pool."""
        group = self._group.get(node, "")
        known = self._rates_known[group]
        return self._rates_sum[group] / known if known else 0.0

    def node_prefill_rate(self, node: str) -> float:
        """``node``'s own learned prefill rate (0: fewer than PREFILL_MIN_SAMPLES samples)."""
        if self._prefill_samples[node] < PREFILL_MIN_SAMPLES:
            return 0.0
        return self._prefill_rate[node]

    def tpot_s(self, node: str) -> float:
        """``node``'s observed time per output token."""
        return self._tpot.get(node, TPOT_PRIOR_S)

    def remaining_decode(self, node: str, now: float) -> int:
        """Output tokens this router's requests on ``node`` are still expected to produce:
        their expected outputs, less what the decoding ones produced at the node's observed
        time per output token (an estimate: a request past its expected output lowers it)."""
        expected = self._expected.get(node, 0)
        if not expected:
            return 0
        k = self._decoding.get(node, 0)
        done = k + (k * now - self._first_sum.get(node, 0.0)) / self._tpot.get(node, TPOT_PRIOR_S)
        return max(0, int(expected - done))

    def unreflected(self, node: str, heartbeat_ts: float) -> int:
        """This router's requests on ``node`` dispatched after its last heartbeat."""
        q = self._recent.get(node)
        if not q:
            return 0
        while q and q[0][0] <= heartbeat_ts:
            q.popleft()
        return sum(1 for _, rid in q if rid in self._entries)

    def router_state(
        self, node: str, heartbeat_ts: float, now: float, group: str = ""
    ) -> tuple[int, int, int, int, float]:
        """What :meth:`router.core.NodeView.with_router_state` takes, in one pass (the decision's
        per-node loop): :meth:`unreflected`, :meth:`prefill_backlog`,
        :meth:`remaining_decode`, :meth:`long_blocks`, :meth:`prefill_rate` (``group``: the
        node's model, whose nodes share a prefill rate)."""
        if self._group.get(node) != group:
            self._group[node] = group
        pending = self.unreflected(node, heartbeat_ts)
        backlog = self._backlog.get(node, 0)
        expected = self._expected.get(node, 0)
        remaining = 0
        if expected:
            k = self._decoding.get(node, 0)
            if k:
                done = k + (k * now - self._first_sum[node]) / self._tpot.get(node, TPOT_PRIOR_S)
                remaining = max(0, int(expected - done))
            else:
                remaining = expected
        known = self._rates_known[group]
        rate = self._rates_sum[group] / known if known else 0.0
        return pending, backlog, remaining, self._long_blocks.get(node, 0), rate

    def prefill_backlog(self, node: str) -> int:
        """Uncached prompt tokens of this router's requests on ``node`` still awaiting prefill."""
        return self._backlog.get(node, 0)

    def sweep(self, now: float) -> int:
        """Drop entries older than the horizon (a lost ``finish`` must not grow the ledger)."""
        old = [rid for rid, e in self._entries.items() if now - e.dispatched_s > self.horizon_s]
        for rid in old:
            self.finish(rid)
        for q in self._recent.values():
            while q and now - q[0][0] > self.horizon_s:
                q.popleft()
        return len(old)
