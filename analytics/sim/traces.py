"""Request traces for replay: the Mooncake JSONL format and the Azure LLM inference CSV format.

Mooncake rows carry ``hash_ids``: prefix-chained ids of 512-token blocks (equal ids are a
reusable prefix). Azure rows carry only arrival times and lengths: every request gets blocks of its
own (no sharing), a control case for routing.
"""

from __future__ import annotations

import csv
import json
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from admission.settings import Priority
from streams.blocks import HASH_MASK

__all__ = [
    "Trace",
    "TraceRequest",
    "causal_hit_bound",
    "hit_bound",
    "load_trace",
    "pooled_lru_bound",
]

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]  # full blocks of ``block_size`` tokens
    session_id: str | None = None
    # blocks the answer completes (prompt + output), when a later request can reuse them
    # (multi-turn chat); otherwise the simulator gives them hashes of their own
    output_block_hashes: tuple[int, ...] = ()
    priority: Priority = "normal"
    slo_class: str | None = None  # its SLO class (admission.slo_classes)
    client: str = "default"  # who sends it (retry behaviour, retry-storm guard)
    request_id: str | None = None  # a recorded request's id (replay from the decision log)


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    block_size: int
    requests: tuple[TraceRequest, ...]

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def scaled(self, factor: float) -> Trace:
        """Arrival times × ``factor`` (< 1 compresses: more load)."""
        t0 = self.requests[0].arrival_s if self.requests else 0.0
        return Trace(
            self.name,
            self.block_size,
            tuple(replace(r, arrival_s=t0 + (r.arrival_s - t0) * factor) for r in self.requests),
        )

    def head(self, n: int) -> Trace:
        return Trace(self.name, self.block_size, self.requests[:n])


def _mooncake(lines: Iterable[str], name: str) -> Trace:
    out = []
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        # ids are small integers; spread them over the hash space (kvgate hashes are 63-bit)
        prompt = int(row["input_length"])
        full = prompt // MOONCAKE_BLOCK_TOKENS  # an engine caches full blocks only
        hashes = tuple(
            (int(h) * 0x9E3779B97F4A7C15 + 1) & HASH_MASK for h in row["hash_ids"][:full]
        )
        out.append(
            TraceRequest(
                float(row["timestamp"]) / 1000.0, prompt, max(1, int(row["output_length"])), hashes
            )
        )
    out.sort(key=lambda r: r.arrival_s)
    return Trace(name, MOONCAKE_BLOCK_TOKENS, tuple(out))


def _azure(rows: Iterable[dict[str, str]], name: str, block_size: int, seed: int) -> Trace:
    rng = random.Random(seed)
    out = []
    t0: datetime | None = None
    for row in rows:
        ts = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
        t0 = t0 or ts
        prompt = int(row["ContextTokens"])
        hashes = tuple(rng.getrandbits(63) for _ in range(prompt // block_size))
        out.append(
            TraceRequest(
                (ts - t0).total_seconds(), prompt, max(1, int(row["GeneratedTokens"])), hashes
            )
        )
    out.sort(key=lambda r: r.arrival_s)
    return Trace(name, block_size, tuple(out))


def load_trace(path: Path, *, azure_block_size: int = 16, seed: int = 0) -> Trace:
    """A Mooncake ``.jsonl`` or an Azure ``.csv`` trace."""
    name = path.stem
    if path.suffix == ".jsonl":
        with path.open() as fh:
            return _mooncake(fh, name)
    if path.suffix == ".csv":
        with path.open(newline="") as fh:
            return _azure(csv.DictReader(fh), name, azure_block_size, seed)
    raise ValueError(f"{path}: expected a Mooncake .jsonl or an Azure .csv trace")


def hit_bound(requests: Sequence[TraceRequest], block_size: int) -> float:
    """Infinite-cache bound: the share of prompt tokens in (full) blocks that an earlier request
    had — what a cache that never evicts could serve."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        total += r.prompt_tokens
        for h in r.block_hashes:
            if h in seen:
                hit += block_size
            else:
                seen.add(h)
        seen.update(r.output_block_hashes)
    return hit / total if total else 0.0


def causal_hit_bound(
    requests: Sequence[TraceRequest],
    block_size: int,
    prefill_tokens_per_s: float,
    step_s: float,
) -> float:
    """The infinite-cache bound without time travel: a block can only be served once some
    request could have computed it — its prompt blocks after that request's prefill on an idle
    engine (``prompt / prefill_tokens_per_s``), its answer blocks after the decode steps that
    fill them (``step_s`` each, the fastest step). Independent of the routing policy. When a
    workload's follow-up turns arrive before the previous answer could exist (chat sessions
    compressed to a high load), :func:`hit_bound` still counts those answers; this does not."""
    ready: dict[int, float] = {}
    hit = total = 0
    for r in sorted(requests, key=lambda x: x.arrival_s):
        total += r.prompt_tokens
        for h in r.block_hashes:
            at = ready.get(h)
            if at is not None and at <= r.arrival_s:
                hit += block_size
        prefilled = r.arrival_s + r.prompt_tokens / prefill_tokens_per_s
        for h in r.block_hashes:
            if prefilled < ready.get(h, float("inf")):
                ready[h] = prefilled
        first_out = len(r.block_hashes)  # the answer's blocks follow the prompt's full blocks
        for j, h in enumerate(r.output_block_hashes):
            end_token = (first_out + j + 1) * block_size  # the block is full at this token
            at = prefilled + max(1, end_token - r.prompt_tokens) * step_s
            if at < ready.get(h, float("inf")):
                ready[h] = at
    return hit / total if total else 0.0


def pooled_lru_bound(
    requests: Sequence[TraceRequest], block_size: int, capacity_blocks: int
) -> float:
    """The hit rate of one LRU cache holding the whole cluster's KV memory
    (``capacity_blocks``): what perfect routing could reach without a bigger cache. Each
    request looks up its prompt's leading blocks, then its prompt and answer blocks become the
    most recently used."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in requests:
        total += r.prompt_tokens
        for h in r.block_hashes:
            if h not in cache:
                break
            hit += block_size
        for h in (*r.block_hashes, *r.output_block_hashes):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / total if total else 0.0
