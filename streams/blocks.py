"""Prompt → tokens → fixed-size blocks → chained block hashes.

The router, the simulated engine and the node agent all use these functions, so a prefix cached by
an engine and a prefix looked up by the router hash to the same ids. Without a model tokenizer,
text is cut into 4-byte chunks ("approximate tokens"); a block hash depends on its parent's hash and
its own token ids, so equal hashes mean equal prefixes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

__all__ = [
    "APPROX_BYTES_PER_TOKEN",
    "HASH_MASK",
    "approx_tokenize",
    "block_hash",
    "chain_hashes",
    "chain_root",
    "detokenize_approx",
    "offloaded",
]

APPROX_BYTES_PER_TOKEN = 4
_SLICE = 1 << 16  # tokens converted in one call (a few ms at most)
HASH_MASK = (1 << 63) - 1  # hashes fit a signed 64-bit column and a JSON integer parser


def approx_tokenize(text: str) -> list[int]:
    """Cut UTF-8 text into 4-byte chunks, each read as one little-endian token id."""
    raw = text.encode("utf-8")
    step = APPROX_BYTES_PER_TOKEN
    pad = (-len(raw)) % step
    if pad:
        raw += b" " * pad
    ids = array("I", raw)
    if len(ids) <= _SLICE:
        return ids.tolist()
    out: list[int] = []
    for i in range(0, len(ids), _SLICE):  # slices: other threads run in between
        out.extend(ids[i : i + _SLICE].tolist())
    return out


def detokenize_approx(token_ids: Sequence[int]) -> str:
    """Inverse of :func:`approx_tokenize` for ids it produced."""
    return array("I", token_ids).tobytes().decode("utf-8", errors="replace")


def chain_root(cache_salt: str | None = None, adapter: str | None = None) -> int | None:
    """The parent of a request's first block (None: an unsalted base-model request).

    Engines hash a request's ``cache_salt`` into its first block and its LoRA adapter into every
    block, so a salted or adapter request's whole chain differs from everyone else's; kvgate
    does the same by seeding the chain with both. Equal roots, equal tokens: equal hashes."""
    if not cache_salt and not adapter:
        return None
    if adapter:
        seed = b"kvgate-chain-root\0" + adapter.encode() + b"\0" + (cache_salt or "").encode()
    else:  # a salt alone: kept as it always was, so salted hashes do not change
        seed = b"kvgate-cache-salt\0" + (cache_salt or "").encode()
    digest = blake2b(seed, digest_size=8).digest()
    return int.from_bytes(digest, "little") & HASH_MASK


OFFLOADED_MARK = 0x5A0F_F10A_DED0_0C0D  # fixed bits: a block's offloaded copy has its own key


def offloaded(block: int) -> int:
    """The index key of ``block``'s copy in an engine's offloaded tier (CPU or disk): an
    offloaded copy is a cheaper miss, not a GPU hit, so it is indexed apart from the block."""
    return block ^ OFFLOADED_MARK


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one block given its parent's hash (None for the first block)."""
    h = blake2b(digest_size=8)
    h.update((parent if parent is not None else HASH_MASK).to_bytes(8, "little"))
    h.update(array("I", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little") & HASH_MASK


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Hashes of every *full* block of ``token_ids``; a partial last block is not cacheable.

    Equal to folding :func:`block_hash` over the blocks, without a per-block conversion (this
    runs on every request)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    step = block_size * 4
    full = (len(token_ids) // block_size) * block_size
    # converted a slice at a time: a long prompt never holds the interpreter in one long call
    span = max(block_size, _SLICE // block_size * block_size)
    prev = (parent if parent is not None else HASH_MASK).to_bytes(8, "little")
    out: list[int] = []
    for start in range(0, full, span):
        raw = array("I", token_ids[start : min(full, start + span)]).tobytes()
        for off in range(0, len(raw), step):
            h = (
                int.from_bytes(
                    blake2b(prev + raw[off : off + step], digest_size=8).digest(), "little"
                )
                & HASH_MASK
            )
            out.append(h)
            prev = h.to_bytes(8, "little")
    return out
