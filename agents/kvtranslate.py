"""Engine KV events → kvgate block hashes and net deltas (pure).

Engines hash blocks their own way; kvgate's router hashes prompts with :mod:`streams.blocks`. The
agent recomputes kvgate's chained hash of every stored block from the token ids that
``BlockStored`` carries, so the two sides cannot silently disagree. It keeps the node's current
set of blocks and, at each flush, emits only the net change since the last flush.

**Block sizes.** kvgate's blocks have the index's size (``block_size``, what the router hashes
with), whatever the engine's: SGLang's pages are often 1 token, vLLM's blocks 16 or more. Engine
blocks are re-chunked: a kvgate block is held while every engine block holding part of it is
(the engine can only reuse a prefix it holds whole); tokens past the last full kvgate block
wait for the engine's next block in the chain.

**What enters.** Only blocks a request can hit as a prefix: GPU blocks of full-attention groups
whose hash kvgate can reproduce. A salted request's chain starts from its salt and an adapter
request's from its LoRA adapter name (:func:`streams.blocks.chain_root`), as the router hashes a
request with the same ``cache_salt`` and ``model``: salted tenants and adapters never share hits
with anyone else. Blocks offloaded to CPU or disk, blocks of sliding-window or mamba groups
(hybrid models), blocks with multimodal or prompt-embedding keys, and LoRA blocks whose adapter
has no name (older releases send only ``lora_id``) are counted in ``skipped_blocks`` and never
claimed as hits. A parent hash of ``0`` or empty bytes is the root, as some publishers write it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from agents.vllm_events import (
    ClearedEvent,
    EngineBatch,
    EngineHash,
    RemovedEvent,
    StoredEvent,
)
from streams.blocks import block_hash, chain_root, offloaded

__all__ = ["PREFIX_KINDS", "KvDelta", "KvHealth", "KvTranslator", "Restarts"]

# KV cache groups whose blocks are reused by prefix (vLLM's KVCacheSpecKind values)
PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_ROOTS: tuple[EngineHash, ...] = (0, b"")

EngineKey = tuple[int, EngineHash]  # (KV cache group, 0 when unnamed; engine hash)
Instance = tuple[EngineKey, int]  # one kvgate block completed by an engine block: (it, index)


@dataclass(frozen=True, slots=True)
class KvDelta:
    stored: list[int]
    removed: list[int]
    cleared: bool

    @property
    def empty(self) -> bool:
        return not (self.stored or self.removed or self.cleared)


@dataclass(slots=True)
class _EngineBlock:
    """What kvgate knows of one engine block: where its chain stands in kvgate's blocks."""

    parent: EngineKey | None
    n_tokens: int
    boundary: int | None  # kvgate hash of the last full kvgate block ending in it or before
    tail: tuple[int, ...]  # its chain's tokens after that boundary (< one kvgate block)
    instances: list[Instance]  # kvgate blocks it is (part of) a copy of


@dataclass(slots=True)
class KvTranslator:
    block_size: int  # kvgate's block size: the unit the router hashes and the index holds
    _by_engine: dict[EngineKey, _EngineBlock] = field(default_factory=dict)
    _live: dict[Instance, int] = field(default_factory=dict)  # intact copies -> kvgate hash
    _copies: Counter[int] = field(default_factory=Counter)  # kvgate hash -> intact copies
    _blocks: set[int] = field(default_factory=set)  # kvgate hashes the engine holds now
    _published: set[int] = field(default_factory=set)  # what consumers were last told
    _touched: set[int] = field(default_factory=set)
    _cleared: bool = False
    _group_kind: dict[int, str] = field(default_factory=dict)  # group_idx -> spec kind
    untranslatable_blocks: int = 0  # parent unknown (events lost) or tokens missing
    translated_blocks: int = 0
    skipped_blocks: Counter[str] = field(default_factory=Counter)  # why, -> blocks
    _offload: KvTranslator | None = None  # the copies in offloaded tiers (CPU, disk)
    _gpu: KvTranslator | None = field(default=None, repr=False)  # set on that tier: the GPU's

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    @property
    def pending(self) -> int:
        return len(self._touched)

    def apply(self, batch: EngineBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, StoredEvent):
                if _on_gpu(ev.medium):
                    self._stored(ev)
                else:
                    self._offload_stored(ev)
            elif isinstance(ev, RemovedEvent):
                target = self if _on_gpu(ev.medium) else self._offload
                if target is not None:
                    for eh in ev.block_hashes:
                        target._removed((ev.group_idx or 0, eh))
            elif isinstance(ev, ClearedEvent):
                self.reset()

    def _offload_stored(self, ev: StoredEvent) -> None:
        """A copy in an offloaded tier (CPU, disk): indexed under :func:`offloaded` keys. A
        self-describing event (tokens, parent) is chained like a GPU one; a bare one (hash only,
        as vLLM's offloading connector sends when it has no more) names the GPU block it is a
        copy of."""
        why = self._skip(ev)
        if why is not None:
            self.skipped_blocks[why] += len(ev.block_hashes)
            return
        if self._offload is None:
            self._offload = KvTranslator(self.block_size, _gpu=self)
        tier = self._offload
        if ev.token_ids and ev.block_size:
            tier._stored(ev)
            return
        for eh in ev.block_hashes:
            key = (ev.group_idx or 0, eh)
            gpu = self._by_engine.get(key)
            done = (
                [self._live[i] for i in gpu.instances if i[0] == key and i in self._live]
                if gpu
                else []
            )
            if gpu is None or not done:
                self.skipped_blocks["offloaded_unknown"] += 1
                continue
            tier._removed(key)
            copy = _EngineBlock(None, gpu.n_tokens, gpu.boundary, gpu.tail, [])
            for j, kh in enumerate(done):
                tier._add_copy((key, j), kh, copy)
            tier._by_engine[key] = copy

    def reset(self) -> None:
        """Forget everything (engine cleared its cache or restarted)."""
        self._by_engine.clear()
        if self._offload is not None:
            self._offload.reset()
        self._live.clear()
        self._copies.clear()
        self._blocks.clear()
        self._published.clear()
        self._touched.clear()
        self._cleared = True

    def _skip(self, ev: StoredEvent) -> str | None:
        """Why the blocks of ``ev`` must not enter the index (None: they may)."""
        if ev.group_idx is not None and ev.kv_cache_spec_kind is not None:
            self._group_kind[ev.group_idx] = ev.kv_cache_spec_kind
        kind = ev.kv_cache_spec_kind or (
            self._group_kind.get(ev.group_idx) if ev.group_idx is not None else None
        )
        if kind is not None and kind not in PREFIX_KINDS:
            return "non_prefix_group"
        if ev.lora_id is not None and not ev.lora_name:
            return "lora"  # hashed with an adapter kvgate cannot name
        for keys in ev.extra_keys or ():
            for k in keys or ():
                if isinstance(k, list | tuple):
                    return "multimodal"  # (image / audio identifier, offset): not reproducible
                if isinstance(k, bytes):
                    return "prompt_embeds"  # a digest of embeddings the router never sees
        return None

    @staticmethod
    def _salt(ev: StoredEvent) -> str | None:
        """The request's ``cache_salt``: SGLang's field, or the string in vLLM's extra keys of
        the first block that is not the adapter's name (vLLM writes the LoRA name first, then
        multimodal keys, then the salt, and salts only the first block)."""
        if ev.cache_salt is not None:
            return ev.cache_salt
        first: Any = (ev.extra_keys or [None])[0]
        strings = [k for k in first or () if isinstance(k, str)]
        if ev.lora_name and strings and strings[0] == ev.lora_name:
            strings = strings[1:]
        return strings[-1] if strings else None

    def _stored(self, ev: StoredEvent) -> None:
        why = self._skip(ev)
        if why is not None:
            self.skipped_blocks[why] += len(ev.block_hashes)
            return
        ebs = ev.block_size or self.block_size
        parent_key: EngineKey | None = None
        boundary: int | None
        tail: tuple[int, ...]
        if ev.parent_block_hash is None or ev.parent_block_hash in _ROOTS:
            boundary, tail = chain_root(self._salt(ev), ev.lora_name), ()
        else:
            parent_key = (ev.group_idx or 0, ev.parent_block_hash)
            parent = self._by_engine.get(parent_key)
            if parent is None and self._gpu is not None:  # an offloaded copy's parent on GPU
                parent = self._gpu._by_engine.get(parent_key)
            if parent is None:  # the parent was never seen (events lost): cannot chain these
                self.untranslatable_blocks += len(ev.block_hashes)
                return
            boundary, tail = parent.boundary, parent.tail
        for i, eh in enumerate(ev.block_hashes):
            own = tuple(ev.token_ids[i * ebs : (i + 1) * ebs])
            if len(own) < ebs:
                self.untranslatable_blocks += len(ev.block_hashes) - i
                return
            key = (ev.group_idx or 0, eh)
            if key in self._by_engine:  # stored again: the engine holds one copy per hash
                self._removed(key)
            block = _EngineBlock(parent_key, ebs, boundary, tail, [])
            tokens = tail + own
            full = len(tokens) // self.block_size
            for j in range(full):
                chunk = tokens[j * self.block_size : (j + 1) * self.block_size]
                boundary = block_hash(boundary, chunk)
                self._add_copy((key, j), boundary, block)
                if j == 0 and tail:  # the first one spans the engine blocks before this one
                    self._spans_back((key, j), parent_key, len(tail))
            tail = tokens[full * self.block_size :]
            block.boundary, block.tail = boundary, tail
            self._by_engine[key] = block
            self.translated_blocks += 1
            parent_key = key

    def _add_copy(self, inst: Instance, kh: int, holder: _EngineBlock) -> None:
        self._live[inst] = kh
        holder.instances.append(inst)
        self._copies[kh] += 1
        if kh not in self._blocks:
            self._blocks.add(kh)
            self._touched.add(kh)

    def _spans_back(self, inst: Instance, key: EngineKey | None, tokens: int) -> None:
        """Record ``inst`` on the engine blocks holding its first ``tokens`` tokens."""
        while tokens > 0 and key is not None:
            block = self._by_engine.get(key)
            if block is None:
                return
            block.instances.append(inst)
            tokens -= block.n_tokens
            key = block.parent

    def _removed(self, key: EngineKey) -> None:
        block = self._by_engine.pop(key, None)
        if block is None:
            return
        for inst in block.instances:
            kh = self._live.pop(inst, None)
            if kh is None:
                continue  # gone already with another engine block it spanned
            self._copies[kh] -= 1
            if self._copies[kh] <= 0:
                del self._copies[kh]
                self._blocks.discard(kh)
                self._touched.add(kh)

    def _held(self) -> set[int]:
        """Index keys of what the engine holds: its GPU blocks and its offloaded copies."""
        tier = self._offload
        if tier is None or not tier._blocks:
            return self._blocks
        return self._blocks | {offloaded(h) for h in tier._blocks}

    def _take_touched(self) -> set[int]:
        touched = self._touched
        tier = self._offload
        if tier is not None and tier._touched:
            touched = touched | {offloaded(h) for h in tier._touched}
            tier._touched.clear()
        return touched

    def take_delta(self) -> KvDelta:
        """Net change since the previous call."""
        held, touched = self._held(), self._take_touched()
        stored = [h for h in touched if h in held and h not in self._published]
        removed = [h for h in touched if h not in held and h in self._published]
        self._published.update(stored)
        self._published.difference_update(removed)
        delta = KvDelta(stored, removed, self._cleared)
        self._touched.clear()
        self._cleared = False
        return delta

    def snapshot(self) -> list[int]:
        """The full current set; consumers replace the node's entries with it."""
        self._take_touched()
        self._touched.clear()
        self._cleared = False
        self._published = set(self._held())
        return list(self._published)


def _on_gpu(medium: str | None) -> bool:
    return medium is None or medium.upper() == "GPU"


@dataclass(slots=True)
class KvHealth:
    """Whether a node's KV events really feed the index (pure; the agent feeds it).

    Degraded when the engine prefilled prompts that no KV event batch accounts for, for longer
    than ``silence_s`` — the events go nowhere (wrong endpoint, connection direction, a format
    nobody decodes) — or batches arrived but none of their stored blocks could be chained into
    kvgate's hashes. Blocks left out on purpose (offloaded, LoRA, salted) do not count.

    "Prefilled" is read from the engine's prompt-token counter, which some engines (and vLLM's
    counters at times) raise only when a request finishes, long after its KV events. So growth
    of the counter after a batch is put down to the requests that were running then, as long as
    the engine has taken on no new work since (its running + waiting requests, read at the
    first scrape after the batch, have not grown) and for at most ``tail_s``. Growth after new
    work arrived, with no batch, is what counts."""

    silence_s: float = 10.0
    min_prompt_tokens: float = 64.0
    tail_s: float = 60.0  # the longest a batch's requests may report prompt tokens after it
    _base: float | None = None  # the counter value batches (or their requests) account for
    _last_batch_s: float | None = None
    _load_ref: int | None = None  # running + waiting at the first scrape after the last batch
    _new_work: bool = False  # more requests than that since the last batch
    _prompt_tokens: float = 0.0
    _unexplained_s: float | None = None  # when growth no batch accounts for was first seen
    _translated_s: float | None = None  # last time a stored block was chained
    _untranslatable_s: float | None = None  # last time one could not be
    reason: str | None = None

    def scraped(self, now: float, prompt_tokens_total: float, load: int | None = None) -> None:
        """One scrape of the engine: its prompt-token counter and, when known, its running +
        waiting requests."""
        if self._base is None or prompt_tokens_total < self._prompt_tokens:
            self._base = prompt_tokens_total  # watching starts, or the engine restarted
        elif self._last_batch_s is not None and load is not None and not self._new_work:
            if self._load_ref is None:
                self._load_ref = load
            if load > self._load_ref:
                self._new_work = True
            elif now - self._last_batch_s <= self.tail_s:
                self._base = prompt_tokens_total  # the batch's requests finishing
        self._prompt_tokens = prompt_tokens_total
        grew = prompt_tokens_total - self._base
        if grew < self.min_prompt_tokens:
            self._unexplained_s = None
        elif self._unexplained_s is None:
            self._unexplained_s = now

    def batch(self, now: float, translated: int, untranslatable: int) -> None:
        self._last_batch_s = now
        self._base = self._prompt_tokens
        self._load_ref, self._new_work, self._unexplained_s = None, False, None
        if translated:
            self._translated_s = now
        if untranslatable:
            self._untranslatable_s = now

    def degraded(self, now: float) -> bool:
        since = self._unexplained_s
        if since is not None and now - since > self.silence_s:
            grew = self._prompt_tokens - (self._base or 0.0)
            self.reason = f"the engine prefilled {grew:.0f} tokens and sent no KV events"
            return True
        untranslatable = self._untranslatable_s
        if untranslatable is not None and now - untranslatable <= self.silence_s:
            if self._translated_s is None or now - self._translated_s > self.silence_s:
                self.reason = "KV events arrive but none of their blocks can be chained"
                return True
        self.reason = None
        return False


@dataclass(slots=True)
class Restarts:
    """Engine restarts, each counted once although two things see it: the metrics scrape (the
    process start time changed, or counters went back) and the KV event stream (its sequence
    started over). A restart one of them saw within ``pair_s`` of the other's is the same
    restart."""

    pair_s: float = 30.0
    count: int = 0
    _unpaired: dict[str, float] = field(default_factory=dict)  # source -> when it saw one

    def seen(self, source: Literal["metrics", "events"], now: float) -> bool:
        """``source`` saw a restart at ``now``: True when it is a new one (counted)."""
        other = "events" if source == "metrics" else "metrics"
        at = self._unpaired.pop(other, None)
        if at is not None and now - at <= self.pair_s:
            return False  # the other source saw (and counted) this one
        self._unpaired[source] = now
        self.count += 1
        return True
