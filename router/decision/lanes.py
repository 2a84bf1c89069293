"""Head-of-line isolation: long requests must not block short ones (pure; shared by the live
router and the simulator).

What a long request does to a short one on the same engine:

* its **prefill** fills the step's token budget, and chunked prefill schedules the running
  prefills first: a short request that arrives behind a 30k-token prompt waits for its chunks,
  and every step it shares with a chunk lasts as long as the chunk;
* its **decode** holds a batch slot and KV blocks for a long time: once an engine is full, a
  short request waits in the engine's queue behind work that will not finish for minutes, and
  an engine out of KV preempts and recomputes (throughput drops just when it is needed most).

A request is *long* when its uncached prompt reaches ``long_prompt_tokens`` or its expected
output (``max_tokens`` capped by what the tenant's answers have been, admission/estimate.py)
reaches ``long_output_tokens``. The rules, applied to the nodes a request may use after the
placement and fleet rules and before the policy:

* **share** — long requests may hold at most ``max_long_kv_share`` of a node's KV blocks
  (prompt + expected output of this router's long requests in flight there,
  router/decision/inflight.py):
  every engine keeps room for short requests, and long ones spread.
* **queue** — a request waits in the router, not in an engine's queue, while its best node
  already has more than ``hold_queue_s`` of prefill queued (or, for a long request, while no
  node has long-request room). The router's queue is ordered: short requests in arrival order, a
  long request as if it had arrived ``long_yield_s`` later. Engines stay at a working point
  instead of thrashing, short requests overtake long ones at the door, and a request waits at
  most ``hold_max_s`` (then it goes to its best node, whatever the queue): nothing starves.
* **lane** (off by default) — long prompts are prefilled on a lane of nodes, sized between
  ``lane_floor`` and ``lane_ceiling`` of the pool from the share of prefill work long prompts
  brought recently; short requests keep off the lane while a node outside it has less than
  ``spill_queue_s`` queued. The lane is a hash of node names (rendezvous), so every router picks
  the same nodes. It takes capacity from short requests: it pays only where long prompts are a
  large share of the work (docs/benchmarks/fleet.md).

The cost policy's model (router/decision/policies/costmodel.py) counts each node's remaining
decode, so that the KV growth of long generations already running there weighs on new requests.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from admission.settings import SloClass
from router.decision.types import NodeView
from router.decision.weights import LaneSettings

__all__ = [
    "LaneFacts",
    "Lanes",
    "lane_facts",
    "may_wait",
]


@dataclass(frozen=True, slots=True)
class LaneFacts:
    """What the lane rules know of one request."""

    expected_output: int
    long: bool = False
    long_prompt: bool = False
    blocks: int = 0  # a long request's KV blocks at its end (0: not long)


def lane_facts(
    prompt: int, uncached: int, expected_output: int, block_size: int, s: LaneSettings
) -> LaneFacts:
    """A request's facts: ``uncached``, the prompt tokens no node holds."""
    long_prompt = uncached >= s.long_prompt_tokens
    long = long_prompt or expected_output >= s.long_output_tokens
    blocks = math.ceil((prompt + expected_output) / block_size) if long else 0
    return LaneFacts(expected_output, long, long_prompt, blocks)


def may_wait(cls: SloClass | None) -> bool:
    """Whether a request of this SLO class may wait in the router's queue: one without a
    class, or of a loose class (one its class holds too, ``hold_queue_s``). A class with a TTFT
    target and no hold is served at once, under deadline-aware admission: queueing it behind
    the lane rules would only have it refused as late."""
    return cls is None or cls.hold_queue_s is not None


def _rank(node_id: str) -> int:
    return zlib.crc32(b"lane|" + node_id.encode())


@dataclass(slots=True)
class Lanes:
    """The lane rules of one router (or one simulated cluster)."""

    s: LaneSettings
    prefill_tokens_per_s: float = 25_000.0  # an engine's prefill rate (the cost model's)
    _avg_prompt: float = 1024.0  # EWMA of the uncached prompt tokens routed
    _long_work: float = 0.0  # decaying sums of prefill tokens: long prompts', everyone's
    _all_work: float = 0.0
    _at: float = 0.0

    def observe(self, uncached_prompt: int, long_prompt: bool, now: float) -> None:
        """A routed request's prefill work (the average prompt; sizes the lane)."""
        if now > self._at:
            k = 0.5 ** ((now - self._at) / self.s.lane_window_s)
            self._long_work *= k
            self._all_work *= k
            self._at = now
        self._avg_prompt += 0.05 * (uncached_prompt - self._avg_prompt)
        self._all_work += uncached_prompt
        if long_prompt:
            self._long_work += uncached_prompt

    def long_share(self) -> float:
        """Long prompts' share of the recent prefill work."""
        return self._long_work / self._all_work if self._all_work > 0 else 0.0

    def queued_s(self, n: NodeView) -> float:
        """Prefill queued on ``n``, in seconds: this router's exact backlog, or the requests
        waiting there at the average prompt (other routers' too), whichever is more."""
        waiting = (n.waiting + n.pending) * self._avg_prompt
        rate = n.prefill_tokens_per_s or self.prefill_tokens_per_s  # learned, else configured
        return max(float(n.prefill_backlog_tokens), waiting) / rate

    def lane(self, nodes: Sequence[NodeView]) -> frozenset[str]:
        """The nodes that prefill long prompts now (none without ``lane``)."""
        s = self.s
        count = len(nodes)
        if not s.lane or count < 2:
            return frozenset()
        lo = max(1, round(count * s.lane_floor))
        hi = max(lo, min(count - 1, int(count * s.lane_ceiling)))
        want = round(count * self.long_share() * s.lane_headroom + 0.5)
        size = min(hi, max(lo, want))
        ranked = sorted(nodes, key=lambda n: _rank(n.node_id))
        return frozenset(n.node_id for n in ranked[:size])

    def select(
        self, nodes: Sequence[NodeView], f: LaneFacts, strict: bool = True
    ) -> list[NodeView]:
        """The nodes a request may use. A long request: the nodes where long requests stay
        within their KV share with it (a node without any always qualifies), on the lane for a
        long prompt; none: it waits (``strict``) or may use every node. A short request: the
        nodes off the lane while one of them has room, else all."""
        lane = self.lane(nodes)
        long_prompt, blocks = f.long_prompt, f.blocks
        if f.long:
            share = self.s.max_long_kv_share
            room = [
                n
                for n in nodes
                if (not long_prompt or not lane or n.node_id in lane)
                and (
                    n.long_kv_blocks == 0
                    or n.long_kv_blocks + blocks <= share * max(1, n.kv_blocks_total)
                )
            ]
            return room if room or strict else list(nodes)
        if not lane:
            return list(nodes)
        out = [n for n in nodes if n.node_id not in lane]
        if any(self.queued_s(n) < self.s.spill_queue_s for n in out):
            return out
        return list(nodes)

    def hold(self, node: NodeView | None) -> bool:
        """Whether a request waits in the router rather than go to ``node``, its best node
        (None: no node may take it now), at once."""
        if node is None:
            return True
        return self.s.hold and self.queued_s(node) > self.s.hold_queue_s

    def key(self, arrival_s: float, long: bool) -> float:
        """A held request's place in the router's queue (smallest first)."""
        return arrival_s + (self.s.long_yield_s if long else 0.0)
