"""Continuous batching over a paged KV cache, in the style of vLLM's scheduler (pure, no I/O).

``EngineCore.step(now)`` schedules one forward pass — decode tokens for running requests, chunks of
prefill within the token budget, new requests while blocks and slots allow — and returns how long
the pass takes and what it produced. The caller advances time (a real sleep in the live engine,
a virtual clock in the simulator) and then delivers the produced tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from agents.kvcache import CacheEvent, KvCache
from agents.profile import EngineProfile, attention_pairs
from agents.sequence import VOCAB, Sequence
from streams.blocks import chain_hashes

__all__ = ["VOCAB", "DecodeRun", "EngineCore", "Sequence", "StepResult"]


@dataclass(frozen=True, slots=True)
class StepResult:
    duration_s: float
    tokens: list[tuple[Sequence, int]]  # (sequence, token id) produced by this step
    finished: list[Sequence]
    prefill_tokens: int
    decode_seqs: int


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """``steps`` consecutive pure-decode steps: step ``i`` (from 0) lasts ``first_s + i·grow_s``
    (the batch is fixed and every sequence's context grows by one token per step)."""

    steps: int
    first_s: float
    grow_s: float

    def elapsed(self, i: int) -> float:
        """Time from the start of the run to the end of its ``i``-th step."""
        return i * self.first_s + self.grow_s * i * (i - 1) / 2

    def steps_done(self, dt: float) -> int:
        """Steps finished ``dt`` seconds after the start."""
        lo, hi = 0, self.steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.elapsed(mid) <= dt:
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass
class EngineCore:
    profile: EngineProfile
    cache: KvCache = field(init=False)
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    preemptions_total: int = 0
    # BlockStored events carry their blocks' token ids (vLLM's format; agents translate hashes
    # with them). The virtual-time simulator reads hashes only and turns this off.
    token_ids_in_events: bool = True

    def __post_init__(self) -> None:
        self.cache = KvCache(self.profile.num_gpu_blocks, self.profile.block_size)
        self._preempted: set[int] = set()

    # --- requests ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if not seq.prompt_hashes and len(seq.prompt) >= self.profile.block_size:
            # a replayed trace brings its own block hashes
            seq.prompt_hashes = chain_hashes(seq.prompt, self.profile.block_size, seq.root)
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Stop a request (client went away); its blocks go back to the cache."""
        if seq.finished:
            return
        seq.aborted = True
        if seq in self.running:
            self.running.remove(seq)
            self._free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finished = True

    def receive(self, seq: Sequence, blocks: int) -> int:
        """The KV of ``seq``'s first ``blocks`` prompt blocks arrives from a prefill engine
        (disaggregated prefill): they enter the cache as if computed here, unreferenced, and
        ``seq`` then hits them like a cached prefix. Returns the blocks that were stored (none
        when the cache has no room: the engine then computes the prompt itself)."""
        bs = self.profile.block_size
        if not seq.prompt_hashes and len(seq.prompt) >= bs:
            seq.prompt_hashes = chain_hashes(seq.prompt, bs, seq.root)
        hashes = seq.prompt_hashes[: max(0, blocks)]
        if not hashes or not self.cache.can_allocate(len(hashes)):
            return 0
        self.cache.allocate(len(hashes))
        tokens = seq.tokens_between(0, len(hashes) * bs) if self.token_ids_in_events else ()
        self.cache.commit(hashes, seq.root, tokens, seq.lora, seq.cache_salt)
        self.cache.release(hashes, 0)
        return len(hashes)

    def fits(self, prompt_tokens: int) -> bool:
        return self.profile.blocks_for_tokens(prompt_tokens + 1) <= self.cache.num_blocks

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # --- one forward pass ----------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        self.cache.expire(now)
        p = self.profile
        budget = p.max_num_batched_tokens
        produced: list[tuple[Sequence, int]] = []
        scheduled: list[tuple[Sequence, int]] = []  # (seq, tokens computed this step)
        decode_seqs = 0
        context = 0
        self._preempted = set()
        # 1. decode: one token for every running request past its prefill
        bs = p.block_size
        preempted = self._preempted
        for seq in list(self.running):
            tokens = seq.n_prompt + len(seq.output)
            # prefilling: fewer tokens computed than all but the last output token
            if budget <= 0 or seq.computed < tokens - (1 if seq.output else 0):
                continue
            if preempted and id(seq) in preempted:
                continue
            # a new block only at a block boundary (the grow check is the slow path)
            if tokens > (len(seq.held) + seq.anon) * bs and not self._grow(seq, tokens):
                continue
            budget -= 1
            decode_seqs += 1
            context += tokens
            scheduled.append((seq, 1))
        # 2. chunked prefill of running requests, then admission of waiting ones
        prefill = 0
        pairs = 0
        for seq in self.running:
            if budget <= 0:
                break
            out = len(seq.output)
            tokens = seq.n_prompt + out
            if seq.computed < tokens - (1 if out else 0):  # still prefilling
                n = min(budget, tokens - seq.computed)
                budget -= n
                prefill += n
                pairs += attention_pairs(seq.computed, n)
                scheduled.append((seq, n))
        while self.waiting and budget > 0 and len(self.running) < p.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = min(budget, seq.tokens - seq.computed)
            budget -= n
            prefill += n
            pairs += attention_pairs(seq.computed, n)
            scheduled.append((seq, n))
        duration = p.step_time_s(decode_seqs, context, prefill, pairs)
        # 3. apply: computed KV is committed to the cache; completed prefills and decodes emit
        finished: list[Sequence] = []
        for seq, n in scheduled:
            if preempted and id(seq) in preempted:  # preempted later in this step
                continue
            seq.computed += n
            if seq.computed // bs > len(seq.held):
                self._commit_full_blocks(seq)
            if seq.computed >= seq.n_prompt + len(seq.output):
                tok = seq.next_token()
                seq.output.append(tok)
                produced.append((seq, tok))
                self.generation_tokens_total += 1
                if seq.first_token_s is None:
                    seq.first_token_s = now + duration
                if len(seq.output) >= seq.max_tokens:
                    finished.append(seq)
        if finished:
            for seq in finished:
                seq.finished = True
                self._free(seq, now + duration)
            self.running = [s for s in self.running if not s.finished]
        return StepResult(duration, produced, finished, prefill, decode_seqs)

    def drain_events(self) -> list[CacheEvent]:
        return self.cache.drain_events()

    # --- fast-forward of steady decoding (the virtual-time simulator) ---------------------
    def plan_decode_run(self) -> DecodeRun | None:
        """The coming steps as one :class:`DecodeRun` when they are certain to be pure decode:
        nothing waits, nothing is prefilling, and the cache has room for every sequence's growth
        (so nothing can be preempted). The run ends with the first sequence to finish.

        Applying the run with :meth:`advance_decode` step by step or at once gives exactly what
        :meth:`step` would; callers must stop the run (finish the step in progress) before adding
        a request.
        """
        p = self.profile
        running = self.running
        if self.waiting or not running or len(running) > p.max_num_batched_tokens:
            return None
        steps = 1 << 30
        context = 0
        for seq in running:
            out = len(seq.output)
            tokens = seq.n_prompt + out
            if seq.computed < tokens - (1 if out else 0):  # prefilling
                return None
            context += tokens
            left = seq.max_tokens - out
            if left < steps:
                steps = left
        if steps < 2:
            return None
        bs = p.block_size
        grow = 0
        for seq in running:
            # blocks for tokens + steps - 1 tokens (ceil), less those held
            need = (seq.n_prompt + len(seq.output) + steps - 2) // bs + 1 - len(seq.held) - seq.anon
            if need > 0:
                grow += need
        if grow > self.cache.free_blocks:
            return None
        batch = len(running)
        first = p.step_time_s(batch, context, 0)
        return DecodeRun(steps, first, p.step_per_context_token_s * batch)

    def advance_decode(self, steps: int) -> list[Sequence]:
        """Apply ``steps`` pure-decode steps of a planned run; returns the finished sequences."""
        if steps <= 0:
            return []
        bs = self.profile.block_size
        cache = self.cache
        finished: list[Sequence] = []
        for seq in self.running:
            tokens = seq.n_prompt + len(seq.output)
            need = (tokens + steps - 2) // bs + 1 - len(seq.held) - seq.anon
            if need > 0:
                cache.allocate(need)
                seq.anon += need
            seq.output.extend(seq.next_tokens(steps))
            seq.computed += steps
            if min(seq.computed, tokens + steps) // bs > len(seq.held):
                self._commit_full_blocks(seq)
            if len(seq.output) >= seq.max_tokens:
                finished.append(seq)
        self.generation_tokens_total += steps * len(self.running)
        if finished:
            for seq in finished:
                seq.finished = True
                self._free(seq)
            self.running = [s for s in self.running if not s.finished]
        return finished

    # --- internals -----------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> bool:
        p = self.profile
        n = seq.tokens
        hashes = seq.block_hashes(n // p.block_size, p.block_size)
        hit = self.cache.match_prefix(hashes)
        hit = min(hit, (n - 1) // p.block_size)  # at least one token is computed
        need = p.blocks_for_tokens(n) - hit
        if not self.cache.can_allocate(need, hashes[:hit]):
            return False
        self.cache.acquire(hashes[:hit])
        self.cache.allocate(need)
        seq.held = list(hashes[:hit])
        seq.anon = need
        seq.computed = hit * p.block_size
        if not seq.output:  # count the first scheduling only, like vLLM's prefix-cache metrics
            seq.cached_tokens = seq.computed
            self.prompt_tokens_total += len(seq.prompt)
            self.prefix_queries_tokens += len(seq.prompt)
            self.prefix_hits_tokens += seq.computed
        return True

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Make room for ``tokens`` in ``seq``, preempting the newest other request if needed."""
        need = self.profile.blocks_for_tokens(tokens) - len(seq.held) - seq.anon
        while need > 0 and not self.cache.can_allocate(need):
            victim = next((s for s in reversed(self.running) if s is not seq), None)
            if victim is None:
                return False
            self._preempt(victim)
        if need > 0:
            self.cache.allocate(need)
            seq.anon += need
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._preempted.add(id(seq))
        self.running.remove(seq)
        self._free(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    def _commit_full_blocks(self, seq: Sequence) -> None:
        bs = self.profile.block_size
        full = min(seq.computed, seq.tokens) // bs
        have = len(seq.held)
        if full <= have:
            return
        hashes = seq.block_hashes(full, bs)[have:]
        parent = seq.held[-1] if seq.held else None
        tokens = seq.tokens_between(have * bs, full * bs) if self.token_ids_in_events else ()
        self.cache.commit(hashes, parent, tokens, seq.lora, seq.cache_salt)
        seq.held.extend(hashes)
        seq.anon -= len(hashes)

    def _free(self, seq: Sequence, finished_s: float | None = None) -> None:
        """``seq``'s blocks back to the cache (finished at ``finished_s`` with a retention
        hint: held for its session's next turn)."""
        hold = finished_s + seq.retain_s if finished_s is not None and seq.retain_s > 0 else None
        self.cache.release(seq.held, seq.anon, hold)
        seq.held = []
        seq.anon = 0
