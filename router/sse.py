"""Reading an OpenAI answer as it passes by (SSE events or one JSON body) without holding it up:
what the endpoint picker learns of the responses Envoy forwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from streams.agentapis import Api, event_token, event_usage, usage_as_chat

__all__ = ["MAX_PENDING_RESPONSE", "ResponseWatch"]

MAX_PENDING_RESPONSE = 1 << 20  # response bytes held while looking for a whole event


@dataclass
class ResponseWatch:
    """What a response streamed past the endpoint picker says so far: its status, the first
    token (text, content, reasoning or a tool call), output tokens counted per event and the
    usage of its last chunk (``api``: a Messages or Responses answer, its events and usage read
    in chat terms). Bounded: a response with no event boundary within ``MAX_PENDING_RESPONSE``
    bytes is not read further."""

    api: Api | None = None
    status: int = 0
    first_token_s: float | None = None
    output_tokens: int = 0
    usage: dict[str, Any] | None = None
    buffer: bytes = b""

    def chunk(self, data: bytes, now: float) -> None:
        """An SSE or JSON piece of the response body."""
        self.buffer += data
        if len(self.buffer) > MAX_PENDING_RESPONSE:  # no event boundary in sight: stop reading
            self.buffer = b""
            return
        if b"\n\n" not in self.buffer and not data.strip().endswith(b"}"):
            return
        events, _, rest = self.buffer.rpartition(b"\n\n")
        if not events and not rest.lstrip().startswith(b"{"):
            return
        self.buffer = rest if events else b""
        for raw in events.split(b"\n\n") if events else [rest]:
            line = raw.strip()
            if line.startswith(b"event:"):  # a named event (the agent APIs): its data line
                line = line.partition(b"\n")[2].strip()
            if line.startswith(b"data:"):
                line = line[5:].strip()
            if not line or line == b"[DONE]":
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(obj, dict):
                continue
            if self.api is not None:
                self._agent(obj, now)
                continue
            if isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            for choice in obj.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta") or choice.get("message") or {}
                text = choice.get("text") or (
                    delta.get("content") if isinstance(delta, dict) else None
                )
                more = isinstance(delta, dict) and any(
                    delta.get(k) for k in ("reasoning_content", "reasoning", "tool_calls")
                )
                if text or more:
                    self.output_tokens += 1
                    if self.first_token_s is None:
                        self.first_token_s = now

    def _agent(self, obj: dict[str, Any], now: float) -> None:
        """One Messages or Responses event, or the whole answer."""
        assert self.api is not None
        whole = obj.get("type") == "message" or obj.get("object") == "response"
        usage = usage_as_chat(self.api, obj.get("usage")) if whole else event_usage(self.api, obj)
        if usage:
            self.usage = {**(self.usage or {}), **usage}
        token = event_token(self.api, obj)
        self.output_tokens += token  # (a whole answer's count is its usage's)
        if (whole or token) and self.first_token_s is None:
            self.first_token_s = now
