"""Request traces for replay: the Mooncake JSONL format and the Azure LLM inference CSV format.

Mooncake rows carry ``hash_ids``: prefix-chained ids of 512-token blocks (equal ids are a
reusable prefix). Azure rows carry only arrival times and lengths: every request gets blocks of its
own (no sharing), a control case for routing.
"""

from __future__ import annotations

import csv
import heapq
import json
import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from admission.settings import Priority
from agents.profile import EngineProfile, attention_pairs
from streams.blocks import HASH_MASK

__all__ = [
    "Trace",
    "TraceRequest",
    "causal_hit_bound",
    "hit_bound",
    "idle_prefill_s",
    "load_trace",
    "pooled_lru_bound",
    "ttft_floors",
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
    # a session's later turn: how long after the previous turn's answer it is sent (a tool
    # call, the user reading); replayed in closed loop (Trace.closed_loop) it arrives then
    think_s: float | None = None
    # in closed loop, a session's first turn that waits for another session to end (a client
    # running a fixed number of sessions at once): sent ``think_s`` after that one's last turn
    after_session: str | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    block_size: int
    requests: tuple[TraceRequest, ...]
    # a session's later turns (``think_s`` set) arrive their think time after the previous
    # turn ended — answered, failed or finally refused — not at their ``arrival_s``
    closed_loop: bool = False

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def scaled(self, factor: float) -> Trace:
        """Arrival times × ``factor`` (< 1 compresses: more load)."""
        t0 = self.requests[0].arrival_s if self.requests else 0.0
        return replace(
            self,
            requests=tuple(
                replace(r, arrival_s=t0 + (r.arrival_s - t0) * factor) for r in self.requests
            ),
        )

    def head(self, n: int) -> Trace:
        return replace(self, requests=self.requests[:n])

    def looped(self, closed: bool = True) -> Trace:
        """This trace replayed in closed loop (or open: every request at its ``arrival_s``)."""
        return replace(self, closed_loop=closed)

    def since(self, offset_s: float) -> Trace:
        """The requests arriving ``offset_s`` or later after the first."""
        if not self.requests:
            return self
        at = self.requests[0].arrival_s + offset_s
        return replace(self, requests=tuple(r for r in self.requests if r.arrival_s >= at))


# AIPerf's reference speed for a session's timing (its own session-duration estimate)
AGENTIC_PREFILL_TOKENS_PER_S, AGENTIC_DECODE_TOKENS_PER_S = 20_000.0, 60.0


def _spread(h: int) -> int:
    """A small block id over kvgate's 63-bit hash space."""
    return (h * 0x9E3779B97F4A7C15 + 1) & HASH_MASK


def _sessions_jsonl(rows: list[dict[str, object]], name: str) -> Trace:
    """Mooncake rows per turn of a session (AIPerf's multi-turn format: each row the turn's new
    tokens; ``timestamp`` on a session's first turn, ``delay`` on the others). Each turn's prompt
    is the whole conversation so far: its first turn's blocks (shared ones keep their ids), then
    every earlier answer and new input in order. A block past the first turn's full ones is the
    session's own (the same hash in every later turn), so the answer's blocks are listed for the
    next turn to reuse. A turn arrives its ``delay`` after the previous turn's answer is due at
    AIPerf's reference speed."""
    bs = MOONCAKE_BLOCK_TOKENS
    out: list[TraceRequest] = []
    state: dict[str, tuple[tuple[int, ...], int, float]] = {}  # first blocks, context, due
    for row in rows:
        sid = str(row["session_id"])
        new, answer = int(str(row["input_length"])), max(1, int(str(row["output_length"])))
        ids = row["hash_ids"]
        assert isinstance(ids, list)
        think: float | None = None
        if sid not in state or "timestamp" in row:  # a first turn (or a session's restart)
            first = tuple(_spread(int(h)) for h in ids[: new // bs])
            context, at = new, float(str(row.get("timestamp", 0.0))) / 1000.0
        else:
            first, context, due = state[sid]
            context += new
            think = float(str(row.get("delay", 0.0))) / 1000.0
            at = due + think
        own = zlib.crc32(sid.encode()) << 20

        def block(j: int, first: tuple[int, ...] = first, own: int = own) -> int:
            return first[j] if j < len(first) else _spread(own + j)

        full, done = context // bs, (context + answer) // bs
        out.append(
            TraceRequest(
                at,
                context,
                answer,
                tuple(block(j) for j in range(full)),
                sid,
                tuple(block(j) for j in range(full, done)),
                think_s=think,
            )
        )
        due = at + new / AGENTIC_PREFILL_TOKENS_PER_S + answer / AGENTIC_DECODE_TOKENS_PER_S
        state[sid] = (first, context + answer, due)
    out.sort(key=lambda r: r.arrival_s)
    return Trace(name, bs, tuple(out))


def _mooncake(lines: Iterable[str], name: str) -> Trace:
    rows = [json.loads(line) for line in lines if line.strip()]
    if rows and "session_id" in rows[0]:
        return _sessions_jsonl(rows, name)
    out = []
    for row in rows:
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


def _causally(
    requests: Sequence[TraceRequest], block_size: int, prefill_tokens_per_s: float, step_s: float
) -> Iterator[tuple[TraceRequest, dict[int, float]]]:
    """Each request in arrival order with the earliest time each block could exist before it
    (block -> time): its prompt blocks once some request could have prefilled them on an idle
    engine (``prompt / prefill_tokens_per_s``), its answer blocks once the decode steps that
    fill them (``step_s`` each, the fastest step) could have run."""
    ready: dict[int, float] = {}
    for r in sorted(requests, key=lambda x: x.arrival_s):
        yield r, ready
        prefilled = r.arrival_s + r.prompt_tokens / prefill_tokens_per_s
        for h in r.block_hashes:
            if prefilled < ready.get(h, math.inf):
                ready[h] = prefilled
        _answer_ready(ready, r, block_size, prefilled, step_s)


def _answer_ready(
    ready: dict[int, float], r: TraceRequest, block_size: int, first_token_s: float, step_s: float
) -> None:
    """The earliest times ``r``'s answer blocks could exist, into ``ready``: each once the
    decode steps that fill it (``step_s`` each, the fastest step) ran after its first token."""
    first_out = len(r.block_hashes)  # the answer's blocks follow the prompt's full blocks
    for j, h in enumerate(r.output_block_hashes):
        end_token = (first_out + j + 1) * block_size  # the block is full at this token
        at = first_token_s + max(1, end_token - r.prompt_tokens) * step_s
        if at < ready.get(h, math.inf):
            ready[h] = at


def causal_hit_bound(
    requests: Sequence[TraceRequest],
    block_size: int,
    prefill_tokens_per_s: float,
    step_s: float,
) -> float:
    """The infinite-cache bound without time travel: a block can only be served once some
    request could have computed it (:func:`_causally`). Independent of the routing policy.
    When a workload's follow-up turns arrive before the previous answer could exist (chat
    sessions compressed to a high load), :func:`hit_bound` still counts those answers; this
    does not."""
    hit = total = 0
    for r, ready in _causally(requests, block_size, prefill_tokens_per_s, step_s):
        total += r.prompt_tokens
        for h in r.block_hashes:
            at = ready.get(h)
            if at is not None and at <= r.arrival_s:
                hit += block_size
    return hit / total if total else 0.0


def _idle_chunks(
    profile: EngineProfile, prompt_tokens: int, cached_tokens: int
) -> Iterator[tuple[int, float]]:
    """The prefill of a prompt on an idle engine that holds its first ``cached_tokens`` (whole
    blocks; at least one token is computed): after each chunk of ``max_num_batched_tokens``
    (one engine step, alone in the batch), the tokens computed so far and the time taken."""
    bs = profile.block_size
    done = min(cached_tokens // bs * bs, (prompt_tokens - 1) // bs * bs)
    t = 0.0
    while done < prompt_tokens:
        n = min(profile.max_num_batched_tokens, prompt_tokens - done)
        t += profile.step_time_s(0, 0, n, attention_pairs(done, n))
        done += n
        yield done, t


def idle_prefill_s(profile: EngineProfile, prompt_tokens: int, cached_tokens: int) -> float:
    """Time to the first token of a prompt on an idle engine that holds its first
    ``cached_tokens`` (:func:`_idle_chunks`)."""
    return max((t for _, t in _idle_chunks(profile, prompt_tokens, cached_tokens)), default=0.0)


def ttft_floors(requests: Sequence[TraceRequest], profile: EngineProfile) -> list[float]:
    """Each request's TTFT floor, in arrival order: the least wait plus prefill on an idle
    engine (:func:`idle_prefill_s`) holding every block of its prompt that exists by the time
    the prefill starts — at its arrival, or later, once more of its prefix exists (an engine
    that queues a request admits it with the blocks cached by then). A block exists once the
    earliest request having it could have computed it on such an engine: a prompt block when the
    chunk holding it ends, an answer block after the decode steps that fill it
    (``step_base_s`` each, the fastest step). No router on a cluster of such engines does better
    for any request, so the floors' percentiles bound every policy's TTFT percentiles from
    below, and the share of floors within an SLO bounds its attainment from above."""
    bs, step_s = profile.block_size, profile.step_base_s
    ready: dict[int, float] = {}
    out: list[float] = []
    for r in sorted(requests, key=lambda x: x.arrival_s):
        now = r.arrival_s
        hashes = r.block_hashes
        # when each prefix length becomes usable (a prefix needs all of its blocks)
        starts: list[tuple[float, int]] = [(now, 0)]  # (start, prefix blocks held then)
        latest = now
        for j, h in enumerate(hashes):
            at = ready.get(h)
            if at is None:
                break
            if at > latest:
                latest = at
                starts.append((latest, j + 1))
            else:
                starts[-1] = (latest, j + 1)
        floor = math.inf
        for start, held in starts:
            wait = start - now
            if wait >= floor:
                break
            t = 0.0
            done = held
            for computed, t in _idle_chunks(profile, r.prompt_tokens, held * bs):
                at = start + t
                for h in hashes[done : computed // bs]:
                    if at < ready.get(h, math.inf):
                        ready[h] = at
                done = computed // bs
            floor = min(floor, wait + t)
        out.append(floor)
        _answer_ready(ready, r, bs, now + floor, step_s)
    return out


def pooled_lru_bound(
    requests: Sequence[TraceRequest],
    block_size: int,
    capacity_blocks: int,
    prefill_tokens_per_s: float | None = None,
    step_s: float | None = None,
) -> float:
    """The hit rate of one LRU cache holding the whole cluster's KV memory
    (``capacity_blocks``): what perfect routing could reach without a bigger cache. Each
    request looks up its prompt's leading blocks, which become the most recently used.

    With ``prefill_tokens_per_s`` and ``step_s``, without time travel (as
    :func:`causal_hit_bound`): a request's prompt blocks enter the cache when it could have
    prefilled them and its answer blocks when the decode steps filling them could have run, so
    a follow-up turn arriving before the previous answer could exist does not find it. Without
    them every block enters at its request's arrival: a turn finds an answer that was not
    written yet (chat sessions compressed to a high load), which no cluster of engines can."""
    causal = bool(prefill_tokens_per_s and step_s)
    cache: OrderedDict[int, None] = OrderedDict()
    due: list[tuple[float, int, int]] = []  # (when a block enters, order, block)
    order = hit = total = 0

    def enter(h: int) -> None:
        cache[h] = None
        cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)

    for r in sorted(requests, key=lambda x: x.arrival_s) if causal else requests:
        while due and due[0][0] <= r.arrival_s:
            enter(heapq.heappop(due)[2])
        total += r.prompt_tokens
        for h in r.block_hashes:
            if h not in cache:
                break
            hit += block_size
            cache.move_to_end(h)
        if not causal:
            for h in (*r.block_hashes, *r.output_block_hashes):
                enter(h)
            continue
        assert prefill_tokens_per_s and step_s
        prefilled = r.arrival_s + r.prompt_tokens / prefill_tokens_per_s
        ready: dict[int, float] = {h: prefilled for h in r.block_hashes}
        _answer_ready(ready, r, block_size, prefilled, step_s)
        for h, at in ready.items():
            order += 1
            heapq.heappush(due, (at, order, h))
    return hit / total if total else 0.0
