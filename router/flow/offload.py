"""Work on a large request body off the event loop.

Parsing, tokenizing and hashing a 4 MiB prompt is ~150 ms of CPU (1 M tokens, 62,500 block
hashes); done on the loop, eight such bodies stalled every other request and ``/health`` for
most of a second. Bodies past :data:`OFFLOAD_BYTES` (and prompts past :data:`OFFLOAD_TOKENS`)
are worked on in a small thread pool instead: the loop keeps serving while they run, taking the
interpreter back at least every switch interval (5 ms), and a real tokenizer (Rust) runs truly in
parallel. Small requests — nearly all of them — stay on the loop, where a thread hop would cost
more than the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

__all__ = ["OFFLOAD_BYTES", "OFFLOAD_TOKENS", "offloaded"]

OFFLOAD_BYTES = 256 << 10  # a body past this is parsed and tokenized off the loop
OFFLOAD_TOKENS = 64 << 10  # a prompt past this many tokens is hashed off the loop

_P = ParamSpec("_P")
_T = TypeVar("_T")
# two threads: enough to keep a core busy beside the loop; more only queue for the interpreter
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgate-offload")


async def offloaded(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` in the offload pool (``fn`` must only read shared state)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, lambda: fn(*args, **kwargs))
