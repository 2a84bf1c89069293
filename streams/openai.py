"""The OpenAI-compatible HTTP surface shared by the router and the simulated engine.

Only what kvgate reads is modelled; unknown fields are kept (``extra="allow"``) and forwarded, so
clients can use engine-specific options. ``render_chat`` is the fallback chat template used when no
model tokenizer is configured: the router and the simulated engine render identically.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "StreamOptions",
    "error_body",
    "render_chat",
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    best_of: int | None = Field(default=None, ge=1, le=128)
    min_tokens: int = Field(default=0, ge=0, le=1_000_000)
    ignore_eos: bool = False
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="vLLM's per-request salt: only requests with the same salt share cache",
    )
    user: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> _Base:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must not be less than n")
        limit = self.given_limit
        if limit is not None and self.min_tokens > limit:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    @property
    def given_limit(self) -> int | None:
        """The output limit the engine applies, when the request sets one: vLLM's chat API takes
        ``max_completion_tokens`` before the older ``max_tokens``; its completions API knows
        only ``max_tokens`` (:class:`CompletionRequest`)."""
        return self.max_completion_tokens or self.max_tokens

    def output_limit(self, default: int) -> int:
        limit = self.given_limit
        return limit if limit is not None else default

    @property
    def sequences(self) -> int:
        """Outputs the engine generates side by side for this request (``n``, ``best_of``)."""
        return max(self.n, self.best_of or 1)


TokenId = Annotated[int, Field(ge=0, lt=2**31)]


MAX_PROMPTS = 256  # prompts in one batched completion request


class CompletionRequest(_Base):
    # one prompt (text or token ids) or, as vLLM takes them, a batch (texts or token-id lists):
    # one choice per prompt and n
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], str | list):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
            if any(isinstance(x, list) and not x for x in v):
                raise ValueError("prompt must not contain an empty token list")
        return v

    @property
    def given_limit(self) -> int | None:
        """``max_tokens`` only: vLLM's completion request has no ``max_completion_tokens`` (a
        client's is ignored, by the engine and so by kvgate's reservation)."""
        return self.max_tokens

    @property
    def batch(self) -> int:
        """How many prompts the request carries."""
        p = self.prompt
        return len(p) if isinstance(p, list) and isinstance(p[0], str | list) else 1

    def prompt_list(self, tokenize: Callable[[str], list[int]]) -> list[list[int]]:
        """Token ids of every prompt: given as ids, or ``tokenize`` applied to their text."""
        p = self.prompt
        if isinstance(p, str):
            return [tokenize(p)]
        if isinstance(p[0], str):
            return [tokenize(str(x)) for x in p]
        if isinstance(p[0], list):
            return [[int(t) for t in x] for x in p]
        return [[int(t) for t in p]]

    def prompt_tokens(self, tokenize: Callable[[str], list[int]]) -> list[int]:
        """Token ids of the (first) prompt."""
        return self.prompt_list(tokenize)[0]

    def prompt_text(self) -> str | None:
        """The (first) prompt's text; None when given as token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        if self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    # vLLM takes any role (custom roles reach the chat template as they are)
    role: str = Field(min_length=1, max_length=64)
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content)

    @property
    def has_media(self) -> bool:
        """An image, audio, video or file part (anything but text)."""
        return isinstance(self.content, list) and any(not _is_text(p) for p in self.content)

    def media_as(self, marker: str) -> ChatMessage:
        """This message with each media part replaced by the text ``marker``."""
        if not self.has_media:
            return self
        assert isinstance(self.content, list)
        parts = [p if _is_text(p) else {"type": "text", "text": marker} for p in self.content]
        return self.model_copy(update={"content": parts})


def _is_text(part: dict[str, Any]) -> bool:
    return bool(part.get("type", "text") == "text")


# arguments of the chat template that a request's chat_template_kwargs may not replace
_RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
    }
)


class ChatRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    # what reaches the chat template, as vLLM passes it (see streams.tokenization)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _template_options(self) -> ChatRequest:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        reserved = set(self.chat_template_kwargs or {}) & _RESERVED_TEMPLATE_ARGS
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
        return self

    @property
    def has_media(self) -> bool:
        return any(m.has_media for m in self.messages)

    def media_as(self, marker: str) -> ChatRequest:
        """This request with every media part replaced by the text ``marker``."""
        return self.model_copy(update={"messages": [m.media_as(marker) for m in self.messages]})

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template sees them: every field the client sent, content
        parts joined into one string (the string content format)."""
        return [
            {**m.model_dump(exclude_none=True), "content": m.text()}
            if m.content is not None
            else m.model_dump(exclude_none=True)
            for m in self.messages
        ]


def render_chat(messages: list[ChatMessage], tail: str = "<|assistant|>\n") -> str:
    """Fallback chat template: one ``<|role|>`` header per message, then ``tail`` (the
    assistant turn's header: the generation prompt)."""
    parts = [f"<|{m.role}|>\n{m.text()}\n" for m in messages]
    parts.append(tail)
    return "".join(parts)


def error_body(
    message: str, type_: str = "invalid_request_error", code: int = 400
) -> dict[str, Any]:
    """An error in vLLM's (OpenAI's) shape: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}
