"""Global admission control, the pure core: cost of a request, budget, watermarks, priorities.

Given the cluster budget (KV blocks and slots of healthy, non-draining nodes), what is already
reserved, and a request's cost, decide: admit, or reject with a typed reason and a Retry-After
computed from how fast reservations drain. Below the yellow watermark everything is admitted;
between yellow and red low priority is rejected; above red high priority is still admitted (up
to the whole budget) and normal priority waits in a bounded queue (:mod:`admission.queue`) —
the verdict says ``queue`` and carries the rejection to use when the queue cannot take it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from admission.settings import AdmissionSettings, Priority

__all__ = [
    "ONE_OUTPUT",
    "Budget",
    "OutputShape",
    "RejectReason",
    "Rejection",
    "Verdict",
    "admit",
    "kv_blocks_for",
    "priority_limit",
    "retry_after",
]


class RejectReason(StrEnum):
    UNAUTHORIZED = "unauthorized"
    TOO_LARGE = "too_large"  # the prompt alone exceeds the largest node's KV
    YELLOW_LOW_PRIORITY = "yellow_low_priority"
    RED_WATERMARK = "red_watermark"
    NO_CAPACITY = "no_capacity"  # no healthy node at all
    RETRY_STORM = "retry_storm"  # retried before Retry-After
    QUEUE_FULL = "queue_full"  # the priority's queue holds as much as it may
    QUEUE_TIMEOUT = "queue_timeout"  # cannot start before its deadline (early) or waited it out
    NODES_UNHEALTHY = "nodes_unhealthy"  # the healthy nodes are backed up (queue cap): 503
    STORE_UNAVAILABLE = "store_unavailable"  # the reservation store is down or being rebuilt
    TENANT_QUOTA = "tenant_quota"  # the tenant is at its concurrency, KV share or fair share
    DEADLINE = "deadline"  # its SLO class's TTFT cannot be met: refused early, not served late
    NO_FIT_NOW = "no_fit_now"  # some node could hold its KV, none can now (router/decision/fit.py)
    RATE_LIMITED = "rate_limited"  # over the tenant's requests or tokens per minute
    SCALING = "scaling"  # no node of its model is ready yet, one is starting (Retry-After)
    PREEMPTED = "preempted"  # admitted sheddable work ended before its first token (preempt.py)


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: RejectReason
    retriable: bool
    retry_after_s: float | None
    message: str


@dataclass(frozen=True, slots=True)
class Budget:
    """One pool's capacity and what admitted requests hold of it."""

    kv_blocks_total: int
    slots_total: int
    kv_blocks_reserved: int
    slots_reserved: int
    largest_node_blocks: int
    drain_blocks_per_s: float  # recent release rate

    def usage_after(self, kv_blocks: int) -> float:
        if self.kv_blocks_total <= 0:
            return math.inf
        kv = (self.kv_blocks_reserved + kv_blocks) / self.kv_blocks_total
        slots = (self.slots_reserved + 1) / max(1, self.slots_total)
        return max(kv, slots)


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    kv_blocks: int
    usage_after: float
    rejection: Rejection | None = None
    queue: bool = False  # over the watermark: wait in the priority queue (rejection if it can't)
    queue_wait_s: float | None = None  # set once a queued request was admitted or refused
    output_estimate: int | None = None  # expected output tokens used for ``kv_blocks``
    local_share: bool = False  # admitted on this router's share: the shared store was away


@dataclass(frozen=True, slots=True)
class OutputShape:
    """What the engine is asked to generate beyond ``max_tokens``."""

    min_tokens: int = 0
    ignore_eos: bool = False  # it generates max_tokens exactly: no learned estimate caps it
    sequences: int = 1  # n / best_of outputs side by side, on one (shared) prompt


ONE_OUTPUT = OutputShape()


def kv_blocks_for(
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    s: AdmissionSettings,
    expected_output: int | None = None,
    shape: OutputShape = ONE_OUTPUT,
) -> int:
    """KV blocks a request will hold: (prompt + expected output) / block size × safety factor.
    The expected output is ``max_tokens`` capped by the learned estimate for the tenant and
    model (:mod:`admission.estimate`) or, before anything is learned, by the configured cap;
    never less than ``min_tokens``, and all of ``max_tokens`` with ``ignore_eos``. Each extra
    sequence (``n``, ``best_of``) adds its own output blocks (the prompt's are shared)."""
    cap = expected_output if expected_output is not None else s.expected_output_cap
    out = max_tokens if shape.ignore_eos else min(max_tokens, cap)
    out = max(out, min(shape.min_tokens, max_tokens))
    blocks = math.ceil((prompt_tokens + out) / block_size)
    blocks += (shape.sequences - 1) * math.ceil(out / block_size)
    return math.ceil(blocks * s.safety_factor)


def priority_limit(priority: Priority, s: AdmissionSettings) -> float:
    """The share of the KV budget reservations may reach with this priority's request in."""
    return {"low": s.yellow_watermark, "normal": s.red_watermark, "high": 1.0}[priority]


def retry_after(seconds: float, s: AdmissionSettings) -> float:
    return min(s.max_retry_after_s, max(s.min_retry_after_s, seconds))


def _retry_after(b: Budget, kv_blocks: int, limit: float, s: AdmissionSettings) -> float:
    excess = b.kv_blocks_reserved + kv_blocks - limit * b.kv_blocks_total
    seconds = excess / b.drain_blocks_per_s if b.drain_blocks_per_s > 0 else s.max_retry_after_s
    return retry_after(seconds, s)


def admit(
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    priority: Priority,
    b: Budget,
    s: AdmissionSettings,
    expected_output: int | None = None,
    shape: OutputShape = ONE_OUTPUT,
) -> Verdict:
    blocks = kv_blocks_for(prompt_tokens, max_tokens, block_size, s, expected_output, shape)
    if b.kv_blocks_total <= 0:
        return Verdict(
            False,
            blocks,
            math.inf,
            Rejection(RejectReason.NO_CAPACITY, True, s.min_retry_after_s, "no healthy capacity"),
        )
    if math.ceil(prompt_tokens / block_size) > b.largest_node_blocks:
        return Verdict(
            False,
            blocks,
            math.inf,
            Rejection(
                RejectReason.TOO_LARGE,
                False,
                None,
                f"the prompt needs {math.ceil(prompt_tokens / block_size)} KV blocks; the largest "
                f"node has {b.largest_node_blocks}",
            ),
        )
    usage = b.usage_after(blocks)
    if usage <= s.yellow_watermark:
        return Verdict(True, blocks, usage)
    if usage <= s.red_watermark:
        if priority != "low":
            return Verdict(True, blocks, usage)
        return Verdict(
            False,
            blocks,
            usage,
            Rejection(
                RejectReason.YELLOW_LOW_PRIORITY,
                True,
                _retry_after(b, blocks, s.yellow_watermark, s),
                f"cluster KV budget at {usage:.0%} (yellow {s.yellow_watermark:.0%}): "
                "low priority is deferred",
            ),
        )
    if priority == "high" and usage <= 1.0:
        return Verdict(True, blocks, usage)
    limit = 1.0 if priority == "high" else s.red_watermark
    return Verdict(
        False,
        blocks,
        usage,
        Rejection(
            RejectReason.RED_WATERMARK,
            True,
            _retry_after(b, blocks, limit, s),
            f"cluster KV budget at {usage:.0%} (red {s.red_watermark:.0%})",
        ),
        queue=s.queue_enabled and priority != "low",
    )
