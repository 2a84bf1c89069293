"""An OpenAI request body → what routing needs (validated, tokenized)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from streams.blocks import approx_tokenize
from streams.openai import ChatRequest, CompletionRequest, render_chat

__all__ = ["ParsedRequest", "parse_request", "request_session"]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    tokens: list[int]
    max_tokens: int
    chat: bool
    session_id: str | None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def parse_request(raw: bytes, chat: bool, default_max_tokens: int) -> ParsedRequest:
    """Raises ``orjson.JSONDecodeError``, ``pydantic.ValidationError`` or ``ValueError`` (→ 400)."""
    body = orjson.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")  # noqa: TRY004 - a 400
    req: ChatRequest | CompletionRequest
    if chat:
        req = ChatRequest.model_validate(body)
        tokens = approx_tokenize(render_chat(req.messages))
    else:
        req = CompletionRequest.model_validate(body)
        tokens = req.prompt_tokens(approx_tokenize)
    return ParsedRequest(
        body=body,
        model=req.model,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        tokens=tokens,
        max_tokens=req.output_limit(default_max_tokens),
        chat=chat,
        session_id=body.get("user") or request_session(body),
    )


def request_session(body: dict[str, Any]) -> str | None:
    """A session key from the body (``session_id`` or ``metadata.session_id``), if any."""
    sid = body.get("session_id")
    if sid is None and isinstance(body.get("metadata"), dict):
        sid = body["metadata"].get("session_id")
    return str(sid) if sid is not None else None
