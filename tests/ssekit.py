"""Reading an OpenAI-style SSE stream as a client does, for tests and benchmarks that check a
stream whole: its ids, text pieces, role deltas, usage blocks and error events."""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["note_event", "stream_record"]


def stream_record() -> dict[str, Any]:
    """What :func:`note_event` fills: the node that served (set by the caller), the chunk ids,
    the text pieces, the role deltas, the usage blocks and the error events."""
    return {"node": None, "ids": set(), "text": [], "roles": 0, "usage": [], "errors": 0}


def note_event(got: dict[str, Any], line: bytes) -> None:
    """One line of the stream into ``got`` (lines other than ``data: {...}`` say nothing)."""
    if not line.startswith(b"data: {"):
        return
    chunk = orjson.loads(line[6:])
    if "error" in chunk:
        got["errors"] += 1
        return
    got["ids"].add(chunk.get("id"))
    if chunk.get("usage"):
        got["usage"].append(chunk["usage"])
    for c in chunk.get("choices") or ():
        delta = c.get("delta")
        got["roles"] += bool(delta and "role" in delta)
        piece = c.get("text") if delta is None else delta.get("content")
        if piece:
            got["text"].append(piece)
