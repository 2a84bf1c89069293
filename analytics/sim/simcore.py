"""The virtual-time simulator's engine: :class:`agents.scheduler.EngineCore`'s scheduling, with the
steady decoders kept as one group instead of one by one (pure, no I/O).

The live engine needs every sequence's tokens every step; the simulator needs only times, cache
contents and counters. In ``EngineCore`` every running request that is past its prefill decodes
one token per step, so a decoding request's length is ``offset + clock`` for one node-wide step
clock. This core keeps that group as numbers (count, sum of offsets) and does per-request work
only where something happens to that request:

* a new KV block at a block boundary (requests grouped by ``offset mod block_size``: the ones
  that need a block at a given step are one bucket),
* a full block committed to the cache (the bucket one step earlier),
* the prefill, the finish, a preemption.

A step costs O(requests prefilling + requests at a block boundary) instead of O(batch); a run of
pure decode steps is applied in O(steps + boundaries). Scheduling, cache contents and order, step
durations, first-token and finish times are exactly ``EngineCore``'s — ``tests/unit/
test_simcore.py`` runs both side by side on random workloads (prefix sharing, chunked prefill,
preemption under memory pressure) and compares every step.

Requests come with the hashes of all their blocks, prompt and answer (the trace's or synthetic
ones), since the simulator never produces token ids.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from agents.kvcache import CacheEvent, KvCache
from agents.profile import EngineProfile, attention_pairs
from agents.scheduler import DecodeRun

__all__ = ["SimCore", "SimSeq", "SimStep"]

WAITING, PREFILL, DECODE, DONE = range(4)


class SimSeq:
    """One request inside a :class:`SimCore`. ``hashes`` covers every full block of the prompt
    and the answer."""

    __slots__ = (
        "anon",
        "cached_tokens",
        "computed",
        "first_token_s",
        "hashes",
        "held",
        "max_tokens",
        "n_prompt",
        "off",
        "out",
        "rank",
        "request_id",
        "retain_s",
        "state",
    )

    def __init__(self, request_id: str, n_prompt: int, max_tokens: int, hashes: list[int]) -> None:
        self.request_id = request_id
        self.n_prompt = n_prompt
        self.max_tokens = max_tokens
        self.hashes = hashes
        self.state = WAITING
        self.rank = -1  # position in the running batch (admission order)
        self.out = 0  # output tokens (while decoding: see SimCore.output_tokens)
        self.computed = 0  # tokens whose KV is in the cache (not kept while decoding)
        self.held = 0  # leading blocks of ``hashes`` referenced (not kept while decoding)
        self.anon = 0  # anonymous blocks held (not kept while decoding)
        self.off = 0  # while decoding: tokens = off + clock at the start of a step
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self.first_token_s: float | None = None
        self.retain_s = 0.0  # a retention hint: its blocks held this long after it ends

    @property
    def finished(self) -> bool:
        return self.state == DONE


@dataclass(frozen=True, slots=True)
class SimStep:
    duration_s: float
    finished: list[SimSeq]
    first: list[SimSeq]  # requests that produced their first token in this step
    prefill_tokens: int
    decode_seqs: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class SimCore:
    """``EngineCore``'s ``add`` / ``step`` / ``plan_decode_run`` / ``advance_decode`` for the
    simulator (no token ids; an abort only before the first token)."""

    def __init__(self, profile: EngineProfile) -> None:
        if profile.max_num_seqs > profile.max_num_batched_tokens:
            # EngineCore could then run out of token budget in its decode pass
            raise ValueError("the simulator needs max_num_seqs <= max_num_batched_tokens")
        self.profile = profile
        self.bs = profile.block_size
        self.cache = KvCache(profile.num_gpu_blocks, profile.block_size)
        self.waiting: deque[SimSeq] = deque()
        self.running: dict[int, SimSeq] = {}  # rank -> request, in admission order
        self.prefilling: dict[int, SimSeq] = {}  # the running requests not decoding, in order
        # decoding requests by offset mod block size: bucket q needs a block at the steps where
        # (q + clock - 1) % bs == 0 and fills one where (q + clock) % bs == 0
        self.buckets: list[dict[int, SimSeq]] = [{} for _ in range(self.bs)]
        self.ends: list[tuple[int, int, SimSeq]] = []  # (finishing step, rank, request)
        self.decoding = 0
        self.sum_off = 0
        self.clock = 0  # steps taken
        self.now = 0.0  # the time of the step being applied (retention holds count from it)
        self._next_rank = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.preemptions_total = 0

    # --- requests ------------------------------------------------------------------------
    def add(self, seq: SimSeq, first: bool = False) -> None:
        """``seq`` waits for its turn (``first``: ahead of every waiting request, as vLLM's
        priority scheduling takes a request of a higher priority)."""
        if len(seq.hashes) < (seq.n_prompt + seq.max_tokens - 1) // self.bs:
            raise ValueError(f"{seq.request_id}: hashes must cover every full block")
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def abort(self, seq: SimSeq, now: float) -> bool:
        """End a request whose first token has not come out by ``now``: waiting, prefilling,
        or in the step that produces it (a step is applied when it starts, its tokens come at
        its end). The engine frees its blocks; the prefix it computed stays cached. False when
        the token is out (or the request finished)."""
        if seq.state == DONE or (seq.first_token_s is not None and seq.first_token_s <= now):
            return False
        if seq.state == WAITING:
            self.waiting.remove(seq)
        else:
            if seq.state == DECODE:  # (decoding from the step in progress on)
                self._leave_decode(seq, self.clock)  # (releases its blocks)
            else:
                self.cache.release(seq.hashes[: seq.held], seq.anon)
                del self.prefilling[seq.rank]
            del self.running[seq.rank]
        seq.held = seq.anon = seq.computed = 0
        seq.state = DONE
        return True

    def receive(self, hashes: list[int], parent: int | None = None) -> int:
        """Prompt blocks whose KV arrives from a prefill engine (disaggregated prefill): cached
        here, unreferenced, as :meth:`agents.scheduler.EngineCore.receive`; none when the cache
        has no room. Returns the blocks stored."""
        if not hashes or not self.cache.can_allocate(len(hashes)):
            return 0
        self.cache.allocate(len(hashes))
        self.cache.commit(hashes, parent, ())
        self.cache.release(hashes, 0)
        return len(hashes)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def output_tokens(self, seq: SimSeq) -> int:
        return seq.off + self.clock - seq.n_prompt if seq.state == DECODE else seq.out

    def drain_events(self) -> list[CacheEvent]:
        return self.cache.drain_events()

    # --- one forward pass ----------------------------------------------------------------
    def step(self, now: float) -> SimStep:
        p = self.profile
        c = self.clock
        cache = self.cache
        self.now = now
        cache.expire(now)  # holds past their time become ordinary cached blocks
        grow = self.buckets[(1 - c) % self.bs]
        if len(grow) <= cache.free_blocks:
            if grow:
                cache.allocate(len(grow))
            decode_seqs = self.decoding
            context = self.sum_off + decode_seqs * c
        else:
            decode_seqs, context = self._grow_preempting(grow, c)
        budget = p.max_num_batched_tokens - decode_seqs
        prefill = 0
        pairs = 0
        scheduled: list[tuple[SimSeq, int]] = []
        for seq in self.prefilling.values():
            if budget <= 0:
                break
            n = min(budget, seq.n_prompt + seq.out - seq.computed)
            budget -= n
            prefill += n
            pairs += attention_pairs(seq.computed, n)
            scheduled.append((seq, n))
        running = self.running
        while self.waiting and budget > 0 and len(running) < p.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            rank = self._next_rank
            self._next_rank += 1
            seq.rank = rank
            seq.state = PREFILL
            running[rank] = seq
            self.prefilling[rank] = seq
            n = min(budget, seq.n_prompt + seq.out - seq.computed)
            budget -= n
            prefill += n
            pairs += attention_pairs(seq.computed, n)
            scheduled.append((seq, n))
        duration = p.step_time_s(decode_seqs, context, prefill, pairs)
        finished = self._decode_tick(c)
        first: list[SimSeq] = []
        if scheduled:
            self._apply_prefill(scheduled, c, now + duration, finished, first)
        self._finish(finished, c + 1)
        self.clock = c + 1
        return SimStep(duration, finished, first, prefill, decode_seqs)

    # --- runs of pure decode steps ----------------------------------------------------------
    def plan_decode_run(self) -> DecodeRun | None:
        """Like ``EngineCore.plan_decode_run``: the coming steps as one run when they are
        certain to be pure decode (nothing waits or prefills, the cache has room for every
        request's growth); the run ends with the first request to finish."""
        p = self.profile
        n = self.decoding
        if self.waiting or self.prefilling or not n or n > p.max_num_batched_tokens:
            return None
        ends = self.ends
        while ends[0][2].state != DECODE or ends[0][2].rank != ends[0][1]:
            heapq.heappop(ends)  # preempted since
        c = self.clock
        steps = ends[0][0] - c + 1
        if steps < 2:
            return None
        bs = self.bs
        full, part = divmod(steps, bs)
        free = self.cache.free_blocks
        if n * (full + (1 if part else 0)) > free:  # the exact count, only when it matters
            buckets = self.buckets
            grow = n * full + sum(len(buckets[(1 - c - j) % bs]) for j in range(part))
            if grow > free:
                return None
        first = p.step_time_s(n, self.sum_off + n * c, 0)
        return DecodeRun(steps, first, p.step_per_context_token_s * n)

    def advance_decode(self, steps: int, now: float | None = None) -> list[SimSeq]:
        """Apply ``steps`` steps of a planned run (``now``: the time of the last of them);
        returns the requests that finished."""
        finished: list[SimSeq] = []
        cache = self.cache
        if now is not None:
            self.now = now
            cache.expire(now)
        buckets = self.buckets
        bs = self.bs
        for c in range(self.clock, self.clock + steps):
            grow = len(buckets[(1 - c) % bs])
            if grow:
                cache.allocate(grow)
            done = self._decode_tick(c)
            if done:
                self._finish(done, c + 1)
                finished += done
        self.clock += max(0, steps)
        return finished

    # --- internals -----------------------------------------------------------------------
    def _decode_tick(self, c: int) -> list[SimSeq]:
        """The decoders' side of step ``c`` after scheduling: each emits a token, those at a
        block boundary commit the block they filled; returns those that reach their end."""
        self.generation_tokens_total += self.decoding
        bs = self.bs
        full = self.buckets[(-c) % bs]
        if full:
            filled = []
            for seq in full.values():
                i = (seq.off + c) // bs - 1  # the block just filled
                h = seq.hashes
                filled.append((h[i], h[i - 1] if i else None))
            self.cache.commit_each(filled)
        ends = self.ends
        finished: list[SimSeq] = []
        while ends and ends[0][0] <= c:
            _, rank, seq = heapq.heappop(ends)
            if seq.state == DECODE and seq.rank == rank:
                finished.append(seq)
        return finished

    def _apply_prefill(
        self,
        scheduled: list[tuple[SimSeq, int]],
        c: int,
        token_s: float,
        finished: list[SimSeq],
        first: list[SimSeq],
    ) -> None:
        bs = self.bs
        cache = self.cache
        for seq, n in scheduled:
            seq.computed += n
            full = seq.computed // bs
            if full > seq.held:
                h = seq.hashes
                have = seq.held
                cache.commit(h[have:full], h[have - 1] if have else None, ())
                seq.anon -= full - have
                seq.held = full
            tokens = seq.n_prompt + seq.out
            if seq.computed >= tokens:
                seq.out += 1
                self.generation_tokens_total += 1
                if seq.first_token_s is None:
                    seq.first_token_s = token_s
                    first.append(seq)
                if seq.out >= seq.max_tokens:
                    finished.append(seq)
                else:  # decoding from the next step: tokens + 1 at clock c + 1
                    del self.prefilling[seq.rank]
                    seq.state = DECODE
                    seq.off = tokens - c
                    self.buckets[seq.off % bs][seq.rank] = seq
                    end = seq.n_prompt + seq.max_tokens - 1 - seq.off
                    heapq.heappush(self.ends, (end, seq.rank, seq))
                    self.decoding += 1
                    self.sum_off += seq.off

    def _finish(self, finished: list[SimSeq], c_next: int) -> None:
        """Free finished requests' blocks (``c_next``: the clock after their last step)."""
        for seq in finished:
            if seq.state == DECODE:
                self._leave_decode(seq, c_next, retain=True)
            else:
                self.cache.release(seq.hashes[: seq.held], seq.anon, self._hold(seq))
                del self.prefilling[seq.rank]
            del self.running[seq.rank]
            seq.state = DONE

    def _hold(self, seq: SimSeq) -> float | None:
        """Until when a finished request's blocks are held (its retention hint), or None."""
        return self.now + seq.retain_s if seq.retain_s > 0 else None

    def _leave_decode(self, seq: SimSeq, c: int, grown: int = 0, retain: bool = False) -> None:
        """Materialize a decoder at clock ``c`` (step start) and release its blocks (held for
        its retention hint when it ``retain``: it finished)."""
        tokens = seq.off + c
        held = (tokens - 1) // self.bs
        cap = _ceil_div(tokens - 1, self.bs) + grown
        self.cache.release(seq.hashes[:held], cap - held, self._hold(seq) if retain else None)
        del self.buckets[seq.off % self.bs][seq.rank]
        self.decoding -= 1
        self.sum_off -= seq.off
        seq.out = tokens - seq.n_prompt

    def _grow_preempting(self, grow: dict[int, SimSeq], c: int) -> tuple[int, int]:
        """The decode pass when the blocks the boundary bucket needs are not all free:
        ``EngineCore._grow`` one request at a time in batch order, preempting the newest other
        request while a block is missing. Returns the decode batch size and context as
        ``EngineCore.step`` counts them (a request preempted after its turn still counts)."""
        cache = self.cache
        running = self.running
        decode_seqs = self.decoding
        context = self.sum_off + decode_seqs * c
        grown: set[int] = set()
        for rank, seq in sorted(grow.items()):
            if seq.state != DECODE:  # preempted earlier in this pass
                continue
            while not cache.can_allocate(1):
                victim = next((s for s in reversed(running.values()) if s is not seq), None)
                if victim is None:
                    raise RuntimeError(f"{seq.request_id} needs more KV blocks than the engine has")
                if victim.state == DECODE and victim.rank > rank:  # before its turn
                    decode_seqs -= 1
                    context -= victim.off + c
                self._preempt(victim, c, 1 if victim.rank in grown else 0)
            cache.allocate(1)
            grown.add(rank)
        return decode_seqs, context

    def _preempt(self, seq: SimSeq, c: int, grown: int) -> None:
        # a preempted session's turn is held like a finished one: it comes back first, and
        # ordinary blocks are the first evicted while holds are on
        if seq.state == DECODE:
            self._leave_decode(seq, c, grown, retain=True)
        else:
            self.cache.release(seq.hashes[: seq.held], seq.anon, self._hold(seq))
            del self.prefilling[seq.rank]
        del self.running[seq.rank]
        seq.state = WAITING
        seq.held = seq.anon = seq.computed = 0
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    def _admit(self, seq: SimSeq) -> bool:
        bs = self.bs
        n = seq.n_prompt + seq.out
        cache = self.cache
        hashes = seq.hashes
        hit = min(cache.match_prefix(hashes[: n // bs]), (n - 1) // bs)
        need = _ceil_div(n, bs) - hit
        reuse = hashes[:hit]
        if not cache.can_allocate(need, reuse):
            return False
        cache.acquire(reuse)
        cache.allocate(need)
        seq.held = hit
        seq.anon = need
        seq.computed = hit * bs
        if not seq.out:  # the first scheduling only, like vLLM's prefix-cache metrics
            seq.cached_tokens = seq.computed
            self.prompt_tokens_total += seq.n_prompt
            self.prefix_queries_tokens += seq.n_prompt
            self.prefix_hits_tokens += seq.computed
        return True
