"""Anthropic's Messages API and OpenAI's Responses API, as an engine turns them into a chat.

Agent clients speak these two (``POST /v1/messages``: Claude Code and the Anthropic SDKs;
``POST /v1/responses``: Codex and the OpenAI Agents SDK). vLLM serves both by converting the
request into a chat conversation and applying the model's chat template, so kvgate makes the same
conversion: a Messages or Responses request is tokenized, hashed, admitted and routed like the
chat request the engine will compute, and turn *n* + 1 of an agent's session finds turn *n*'s
prefix where it left it. The body itself goes to the engine unchanged (the engine converts it
again; the client gets the engine's own answer).

The conversion follows vLLM's (``vllm/entrypoints/anthropic``, ``responses_utils``):

* Messages: ``system`` (a string or text blocks) and system-role messages become one system
  message; text blocks become the content (one text part: a plain string); ``tool_use`` blocks
  become ``tool_calls`` (arguments as ``json.dumps`` of the input); a user's ``tool_result``
  becomes a ``tool`` message ahead of the rest of its turn; ``thinking`` becomes ``reasoning``;
  images become ``image_url`` parts; tools become function tools.
* Responses: ``instructions`` becomes the system message; a string ``input`` one user message;
  input items become messages: ``function_call`` items join the assistant message before them as
  ``tool_calls``, ``function_call_output`` items become ``tool`` messages, ``reasoning`` items the
  assistant's ``reasoning``, output messages its content; flat function tools are wrapped.

Answers: the usage each API reports (``input_tokens``, ``output_tokens``, cached input) is read
into the chat usage kvgate accounts in (:func:`usage_as_chat`), and a stream's events say when a
token arrived (:func:`event_token`, :func:`event_usage`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from streams.openai import ChatRequest

__all__ = [
    "API_PATHS",
    "Api",
    "MessagesRequest",
    "ResponsesRequest",
    "agent_api",
    "event_token",
    "event_usage",
    "usage_as_chat",
]

Api = Literal["completions", "chat", "messages", "responses"]
API_PATHS: dict[Api, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}


def agent_api(path: str) -> Api | None:
    """The agent API a request path names (``/v1/messages``, ``/v1/responses``), if any."""
    base = path.split("?", 1)[0]
    return (
        "messages"
        if base == API_PATHS["messages"]
        else ("responses" if base == API_PATHS["responses"] else None)
    )


# the field that limits the output, per API (the router sets its default when a client did not)
LIMIT_FIELD: dict[Api, str] = {
    "completions": "max_tokens",
    "chat": "max_tokens",
    "messages": "max_tokens",
    "responses": "max_output_tokens",
}
_BILLING = "x-anthropic-billing-header"  # a per-request line some clients put in the system


def _text_blocks(blocks: list[dict[str, Any]]) -> list[str]:
    return [
        str(b["text"])
        for b in blocks
        if b.get("type") == "text" and b.get("text") and not str(b["text"]).startswith(_BILLING)
    ]


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(i.get("text", ""))
            for i in content
            if isinstance(i, dict) and i.get("type") == "text"
        )
    return ""


# roles some agent clients send that the engine reads as a user's (as vLLM maps them)
_USER_ROLES = frozenset({"ctx", "msg"})


class _AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1, max_length=64)
    content: str | list[dict[str, Any]]

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        return "user" if v in _USER_ROLES else v

    def as_chat(self, out: list[dict[str, Any]]) -> None:
        """Append this message's chat messages to ``out``."""
        if isinstance(self.content, str):
            out.append({"role": self.role, "content": self.content})
            return
        msg: dict[str, Any] = {"role": self.role}
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for b in self.content:
            kind = b.get("type")
            if kind == "text" and b.get("text"):
                parts.append({"type": "text", "text": str(b["text"])})
            elif kind == "image" and isinstance(b.get("source"), dict):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b["source"])}})
            elif kind == "thinking" and b.get("thinking") is not None:
                reasoning.append(str(b["thinking"]))
            elif kind == "tool_use":
                function = {
                    "name": b.get("name") or "",
                    "arguments": json.dumps(b.get("input") or {}),
                }
                calls.append({"id": b.get("id") or "", "type": "function", "function": function})
            elif kind == "tool_result" and self.role == "user":
                tool_id = b.get("tool_use_id") or ""
                text = _tool_result_text(b.get("content"))
                out.append({"role": "tool", "tool_call_id": tool_id, "content": text})
            elif kind == "tool_result":
                text = str(b.get("content")) if b.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {text}"})
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        if parts:
            one_text = len(parts) == 1 and parts[0]["type"] == "text"
            msg["content"] = parts[0]["text"] if one_text else parts
        if self.role == "user" and "content" not in msg:
            return  # only tool results: they are their own messages
        out.append(msg)


class MessagesRequest(BaseModel):
    """``POST /v1/messages`` (what kvgate reads of it; the rest goes to the engine as sent)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[_AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_chat(self) -> ChatRequest:
        """The chat request the engine makes of this one."""
        system = [self.system] if isinstance(self.system, str) else _text_blocks(self.system or [])
        for m in self.messages:
            if m.role == "system":
                system += [m.content] if isinstance(m.content, str) else _text_blocks(m.content)
        messages: list[dict[str, Any]] = []
        if system:
            messages.append({"role": "system", "content": "".join(system)})
        for m in self.messages:
            if m.role != "system":
                m.as_chat(messages)
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    # (an input schema without a type is an object's, as the engine reads it)
                    "parameters": {"type": "object", **(t.get("input_schema") or {})},
                },
            }
            for t in self.tools or []
        ]
        # (no cache_salt: the engine's Messages API does not take one, its prefix is unsalted)
        return _chat(self.model, messages, tools, self.max_tokens, self.chat_template_kwargs)


def _part(part: dict[str, Any]) -> dict[str, Any]:
    """A Responses content part as a chat part."""
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": str(part.get("text", ""))}
    if kind == "input_image":
        return {"type": "image_url", "image_url": {"url": str(part.get("image_url", ""))}}
    return part  # input_file, input_audio…: media the router cannot reproduce


def _item(item: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    """Append (or merge into the assistant message before it) one Responses input item."""
    kind = item.get("type", "message")
    prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        arguments = (
            item.get("arguments", "")
            if kind == "function_call"
            else json.dumps({"input": item.get("input")})
        )
        call = {
            "id": item.get("call_id", ""),
            "type": "function",
            "function": {"name": item.get("name", ""), "arguments": arguments},
        }
        if prev is not None and isinstance(prev.setdefault("tool_calls", []), list):
            prev["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        result = output if isinstance(output, str) else json.dumps(output)
        messages.append(
            {"role": "tool", "tool_call_id": item.get("call_id", ""), "content": result}
        )
    elif kind == "reasoning":
        texts = item.get("content") or item.get("summary") or [{}]
        text = str(texts[0].get("text", "")) if isinstance(texts[0], dict) else ""
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            messages.append({"role": "assistant", "reasoning": text})
    elif item.get("role") == "assistant":
        content = item.get("content")
        said: str | None = content if isinstance(content, str) else None
        if isinstance(content, list) and content and isinstance(content[0], dict):
            said = str(content[0].get("text", ""))
        if said is None:
            return
        if prev is not None and prev.get("content") is None:
            prev["content"] = said
        else:
            messages.append({"role": "assistant", "content": said})
    elif "role" in item:
        content = item.get("content")
        if isinstance(content, list):
            content = [_part(p) for p in content if isinstance(p, dict)]
        messages.append({"role": item["role"], "content": content})


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (what kvgate reads of it; the rest goes to the engine as sent)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    def to_chat(self) -> ChatRequest:
        """The chat request the engine makes of this one."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                _item(item, messages)
        tools = (
            [
                {"type": "function", "function": t}
                for t in self.tools or []
                if t.get("type") == "function"
            ]
            if self.tool_choice != "none"
            else []
        )
        limit, kwargs = self.max_output_tokens, self.chat_template_kwargs
        return _chat(self.model, messages, tools, limit, kwargs, self.cache_salt)


def _chat(
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    limit: int | None,
    kwargs: dict[str, Any] | None,
    cache_salt: str | None = None,
) -> ChatRequest:
    if not messages:
        raise ValueError("the request has no message the model would see")
    return ChatRequest.model_validate(
        {
            "model": model,
            "messages": messages,
            "tools": tools or None,
            "max_tokens": limit,
            "chat_template_kwargs": kwargs,
            "cache_salt": cache_salt,
        }
    )


def usage_as_chat(api: Api, usage: Any) -> dict[str, Any] | None:
    """A Messages or Responses usage in the chat API's keys (prompt, completion and cached
    tokens); a chat or completion usage as it is."""
    if not isinstance(usage, dict):
        return None
    if api in ("chat", "completions"):
        return usage
    if api == "messages":
        cached = usage.get("cache_read_input_tokens")
    else:
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
    out: dict[str, Any] = {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return {k: v for k, v in out.items() if v is not None}


# the stream events that carry one generated piece (a token, or a few)
_TOKEN_EVENTS = {
    "messages": frozenset({"content_block_delta"}),
    "responses": frozenset(
        {
            "response.output_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_summary_text.delta",
            "response.function_call_arguments.delta",
            "response.custom_tool_call_input.delta",
        }
    ),
}
_END_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def event_token(api: Api, event: dict[str, Any]) -> bool:
    """Whether a Messages or Responses stream event carries generated output."""
    return event.get("type") in _TOKEN_EVENTS.get(api, ())


def event_usage(api: Api, event: dict[str, Any]) -> dict[str, Any] | None:
    """The usage a Messages or Responses stream event reports (in chat keys), if any."""
    kind = event.get("type")
    if api == "messages":
        if kind == "message_start":
            return usage_as_chat(api, (event.get("message") or {}).get("usage"))
        if kind == "message_delta":
            return usage_as_chat(api, event.get("usage"))
    elif api == "responses" and kind in _END_EVENTS:
        return usage_as_chat(api, (event.get("response") or {}).get("usage"))
    return None
