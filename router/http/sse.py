"""Reading an engine's SSE stream as it arrives (:class:`SseLines`): what the outcome needs
— the first token, the output tokens, the usage — learned on the way, and the client's bytes
returned without holding any back."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from router.flow.served import Served
from router.http.resume import Splice, Trail
from streams.agentapis import Api, event_token, event_usage

__all__ = ["SseLines"]


def _has_text(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries the first generated token: text, content, reasoning
    (vLLM's ``reasoning_content``, newer ``reasoning``) or a tool call."""
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))


class SseLines:
    """Reads an engine's SSE stream chunk by chunk as it arrives: notes the first token, the
    output tokens and the usage, and returns the bytes for the client — the complete lines of
    the chunk, less the usage chunk the router asked for on the client's behalf (and its blank
    line). A line split over chunks waits for its end. The agent APIs' events (``api``:
    Messages, Responses) are read for their tokens and usage and all passed on."""

    __slots__ = (
        "api",
        "first_token",
        "include_usage",
        "relay",
        "rest",
        "skip_blank",
        "splice",
        "started",
        "trail",
    )

    def __init__(
        self,
        relay: Served,
        include_usage: bool,
        first_token: Callable[[], None] | None,
        started: float,
        api: Api | None = None,
        trail: Trail | None = None,
        splice: Splice | None = None,
    ) -> None:
        self.relay, self.include_usage = relay, include_usage
        self.first_token, self.started = first_token, started
        self.api = api
        self.trail, self.splice = trail, splice  # (router/http/resume.py)
        self.rest = b""
        self.skip_blank = False

    def feed(self, data: bytes, final: bool = False) -> bytes:
        """The client's bytes of ``data`` (``final``: the stream ended; an unterminated last
        line counts as a line)."""
        if self.rest:
            data, self.rest = self.rest + data, b""
        end = len(data) if final else data.rfind(b"\n") + 1
        if end < len(data):
            data, self.rest = data[:end], data[end:]
        if not data:
            return b""
        if b"data: {" not in data and not self.skip_blank:
            return data  # keep-alives, comments, blank lines, [DONE]: nothing to look at
        kept: list[bytes] = []
        at = 0
        while at < len(data):
            nl = data.find(b"\n", at) + 1 or len(data)
            line, at = data[at:nl], nl
            if self.skip_blank:
                self.skip_blank = False
                if line in (b"\n", b"\r\n"):
                    continue
            if line.startswith(b"data: {"):
                sent = self._look(line)
                if sent is None:
                    # the usage chunk we asked for (not the client's), a continuation's
                    # second role delta: dropped, with the blank line that ends the event
                    self.skip_blank = True
                    continue
                line = sent
            kept.append(line)
        return b"".join(kept)

    def _look(self, line: bytes) -> bytes | None:
        """The data line as the client gets it (None: not at all)."""
        relay = self.relay
        chunk = orjson.loads(line[6:])
        if self.api is not None:
            usage = event_usage(self.api, chunk)
            if usage:
                relay.usage = {**(relay.usage or {}), **usage}
            if event_token(self.api, chunk):
                self._token()
            return line
        if self.splice is not None:  # a continuation: made part of the first stream
            spliced = self.splice.rewrite(chunk)
            if spliced is None:
                return None
            chunk, line = spliced, b"data: " + orjson.dumps(spliced) + b"\n"
        if chunk.get("usage"):
            relay.usage = chunk["usage"]
            if not chunk.get("choices") and not self.include_usage:
                return None
        if self.trail is not None:
            self.trail.observe(chunk)
        choices = chunk.get("choices")
        if choices and _has_text(choices[0]):
            self._token()
        return line

    def _token(self) -> None:
        relay = self.relay
        relay.output_tokens += 1
        if relay.ttft_s is None:
            relay.ttft_s = time.time() - self.started
            if self.first_token is not None:
                self.first_token()
