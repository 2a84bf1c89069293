"""The simulated engine's answers in each API's shape, as vLLM writes them.

One request's answer: streamed (SSE, one event per generated token) or whole, for the OpenAI
completions and chat APIs, Anthropic's Messages API (``message_start``, ``content_block_*``,
``message_delta`` with the usage, ``message_stop``) and OpenAI's Responses API
(``response.created``, ``response.output_text.delta``…, ``response.completed`` or, at the output
limit, ``response.incomplete``, each with the usage). The engine generates to the output limit,
so every answer ends for that reason. Usage comes in as the chat API counts it and goes out in
each API's keys (cached prompt tokens: ``cached_tokens``, ``cache_read_input_tokens``,
``input_tokens_details.cached_tokens``).
"""

from __future__ import annotations

from typing import Any

import orjson

from streams.agentapis import Api

__all__ = ["AnswerFormat"]


def _sse(event: dict[str, Any], name: str | None = None) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + orjson.dumps(event) + b"\n\n"


class AnswerFormat:
    """How one request's answer is written (``api``: the endpoint it came in by)."""

    def __init__(self, api: Api, rid: str, created: int, model: str, include_usage: bool) -> None:
        self.api, self.rid, self.created, self.model = api, rid, created, model
        self.include_usage = include_usage
        self._seq = 0  # the Responses API numbers its events
        self._text: list[str] = []

    @staticmethod
    def request_id(api: Api, uid: str) -> str:
        prefix = {"completions": "cmpl-", "chat": "chatcmpl-", "messages": "msg_"}
        return prefix.get(api, "resp_") + uid

    # --- usage -----------------------------------------------------------------------
    def usage(self, chat_usage: dict[str, Any]) -> dict[str, Any]:
        """``chat_usage`` in this API's keys."""
        prompt, out = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
        cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
        if self.api == "messages":
            return {"input_tokens": prompt, "output_tokens": out, "cache_read_input_tokens": cached}
        if self.api == "responses":
            return {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + out,
            }
        return chat_usage

    # --- streams ---------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> bytes:
        """A Responses stream event."""
        self._seq += 1
        return _sse({"type": kind, "sequence_number": self._seq, **fields}, kind)

    def _response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": [self._output_item("completed")] if status != "in_progress" else [],
        }
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if usage is not None:
            out["usage"] = usage
        return out

    def _output_item(self, status: str) -> dict[str, Any]:
        text = "".join(self._text)
        return {
            "type": "message",
            "id": "msg_" + self.rid,
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }

    def start(self, prompt_tokens: int, cached_tokens: int) -> bytes:
        """What a stream opens with, once the prompt is computed (Messages: the input usage,
        cached tokens included, as Anthropic's API reports it there)."""
        if self.api == "messages":
            message: dict[str, Any] = {
                "id": self.rid,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": self.model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": prompt_tokens,
                    "output_tokens": 0,
                    "cache_read_input_tokens": cached_tokens,
                },
            }
            return _sse({"type": "message_start", "message": message}, "message_start") + _sse(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
                "content_block_start",
            )
        if self.api == "responses":
            item = {**self._output_item("in_progress"), "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            ids = {"item_id": item["id"], "output_index": 0}
            return (
                self._event("response.created", response=self._response("in_progress", None))
                + self._event("response.output_item.added", output_index=0, item=item)
                + self._event("response.content_part.added", **ids, content_index=0, part=part)
            )
        return b""

    def piece(self, text: str, first: bool) -> bytes:
        """One generated token's event."""
        self._text.append(text)
        if self.api == "messages":
            delta = {"type": "text_delta", "text": text}
            event = {"type": "content_block_delta", "index": 0, "delta": delta}
            return _sse(event, "content_block_delta")
        if self.api == "responses":
            return self._event(
                "response.output_text.delta",
                item_id="msg_" + self.rid,
                output_index=0,
                content_index=0,
                delta=text,
            )
        base = self._chunk_base()
        if self.api == "chat":
            delta_: dict[str, Any] = {"content": text}
            if first:
                delta_["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta_, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": None}
        return b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"

    def end(self, chat_usage: dict[str, Any]) -> bytes:
        """What a stream closes with: the finish reason and the usage."""
        usage = self.usage(chat_usage)
        if self.api == "messages":
            delta = {"stop_reason": "max_tokens", "stop_sequence": None}
            return (
                _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                + _sse({"type": "message_delta", "delta": delta, "usage": usage}, "message_delta")
                + _sse({"type": "message_stop"}, "message_stop")
            )
        if self.api == "responses":
            text = "".join(self._text)
            ids = {"item_id": "msg_" + self.rid, "output_index": 0}
            part = {"type": "output_text", "text": text, "annotations": []}
            return (
                self._event("response.output_text.done", **ids, content_index=0, text=text)
                + self._event("response.content_part.done", **ids, content_index=0, part=part)
                + self._event(
                    "response.output_item.done", output_index=0, item=self._output_item("completed")
                )
                + self._event("response.incomplete", response=self._response("incomplete", usage))
            )
        base = self._chunk_base()
        end: dict[str, Any] = (
            {"index": 0, "delta": {}, "finish_reason": "length"}
            if self.api == "chat"
            else {"index": 0, "text": "", "finish_reason": "length"}
        )
        out = b"data: " + orjson.dumps({**base, "choices": [end]}) + b"\n\n"
        if self.include_usage:
            out += b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n"
        return out + b"data: [DONE]\n\n"

    def _chunk_base(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.api == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    # --- whole answers -----------------------------------------------------------------
    def whole(self, text: str, chat_usage: dict[str, Any]) -> dict[str, Any]:
        """The answer not streamed."""
        usage = self.usage(chat_usage)
        if self.api == "messages":
            return {
                "id": self.rid,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": "max_tokens",
                "stop_sequence": None,
                "usage": usage,
            }
        if self.api == "responses":
            self._text = [text]
            return self._response("incomplete", usage)
        choice: dict[str, Any] = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            if self.api == "chat"
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        return {
            "id": self.rid,
            "object": "chat.completion" if self.api == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }
