"""One request inside the simulated engine: its prompt, its output (a deterministic token stream
per request), the blocks it holds and how far its KV is computed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from streams.blocks import approx_tokenize, chain_hashes, chain_root

__all__ = ["VOCAB", "Sequence", "first_salt"]

# Output tokens are 4-byte words so that generated text re-tokenizes to the same ids.
VOCAB: tuple[int, ...] = tuple(
    approx_tokenize(w)[0]
    for w in (
        "the ",
        "kv  ",
        "and ",
        "of  ",
        "to  ",
        "gpu ",
        "is  ",
        "in  ",
        "for ",
        "a   ",
        "on  ",
        "it  ",
        "we  ",
        "by  ",
        "as  ",
        "at  ",
        "or  ",
        "be  ",
        "an  ",
        "can ",
    )
)

_WORD = {tok: i for i, tok in enumerate(VOCAB)}


def first_salt(prompt: list[int] | bytes, seed: object, drawn: int) -> int:
    """Where a request's output starts in the cycle of output words: the word after the
    prompt's last token when that is an output word (a request that continues a text the model
    generated goes on with it, as a model decoding greedily does), else the request's ``seed``
    (the same answer for the same seed), else ``drawn``."""
    if isinstance(prompt, list) and prompt and prompt[-1] in _WORD:
        return (_WORD[prompt[-1]] + 7) % len(VOCAB)
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed % len(VOCAB)
    return drawn


# per salt, one period of the output token sequence (next_token's formula)
_CYCLES: tuple[list[int], ...] = tuple(
    [VOCAB[(salt + 7 * i) % len(VOCAB)] for i in range(len(VOCAB))] for salt in range(len(VOCAB))
)


@dataclass(slots=True, eq=False)  # identity: two requests are never "equal"
class Sequence:
    """One request inside the engine."""

    request_id: str
    prompt: list[int] | bytes  # token ids (bytes: a placeholder prompt of zeros)
    max_tokens: int
    arrival_s: float
    rng: random.Random
    prompt_hashes: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # cached block hashes referenced, in order
    anon: int = 0  # anonymous blocks held
    computed: int = 0  # tokens whose KV is in the cache
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    first_token_s: float | None = None
    finished: bool = False
    aborted: bool = False
    lora: str | None = None  # the LoRA adapter it runs with (in its block hashes, as vLLM's)
    cache_salt: str | None = None  # its cache_salt (in its first block's hash, as vLLM's)
    retain_s: float = 0.0  # a retention hint: its blocks held this long after it finishes
    n_prompt: int = field(init=False)
    salt: int = field(init=False)
    root: int | None = field(init=False)  # the parent of its first block

    def __post_init__(self) -> None:
        self.n_prompt = len(self.prompt)
        self.salt = self.rng.randrange(len(VOCAB))
        self.root = chain_root(self.cache_salt, self.lora)

    @property
    def tokens(self) -> int:
        return self.n_prompt + len(self.output)

    def next_token(self) -> int:
        """The simulated model's next output token (deterministic per request)."""
        return VOCAB[(self.salt + 7 * len(self.output)) % len(VOCAB)]

    def next_tokens(self, n: int) -> list[int]:
        """The next ``n`` output tokens (what ``n`` calls of :meth:`next_token` would give)."""
        period = len(VOCAB)
        cycle = _CYCLES[self.salt]
        start = len(self.output) % period
        reps = (start + n) // period + 1
        return (cycle * reps)[start : start + n]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Token ids in ``[start, end)`` of prompt + output, without copying the whole prompt."""
        n = len(self.prompt)
        if end <= n:
            return list(self.prompt[start:end])
        if start >= n:
            return self.output[start - n : end - n]
        return list(self.prompt[start:]) + self.output[: end - n]

    def block_hashes(self, blocks: int, block_size: int) -> list[int]:
        """Hashes of the first ``blocks`` full blocks: the prompt's (given or computed at
        arrival), then blocks holding output, chained on."""
        have = self.prompt_hashes[:blocks]
        if blocks <= len(have):
            return have
        start = len(have) * block_size
        tail = self.tokens_between(start, blocks * block_size)
        return have + chain_hashes(tail, block_size, have[-1] if have else self.root)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.tokens - (1 if self.output else 0)
