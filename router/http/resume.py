"""Continuing a stream on another node when its engine dies mid-answer.

While a chat or completion stream is relayed, a :class:`Trail` keeps what the client has been
sent: the stream's id, creation time and model, the generated text and how many tokens carried
it. When the engine's connection breaks (reset, engine gone, drained past its grace, the
stream's engine went quiet), :func:`continuation` makes the request that produces the rest —
the prompt plus the text so far (a chat gets the text as the final assistant message with
``continue_final_message``, as vLLM and SGLang take it; a completion gets it appended to the
prompt), the output limits reduced by what was produced, the sampling parameters as they were —
and a :class:`Splice` makes the new engine's events part of the first stream: the same id and
creation time, no second role delta, one usage block that counts the whole answer. The client
sees one SSE stream.

What cannot be continued this way is not: several choices, log probabilities, echoed prompts,
tool calls and reasoning deltas (their structure is not text to append), token-id prompts, and
the Messages and Responses APIs (their events carry state of their own). Those streams end with
the error event as before.
"""

from __future__ import annotations

from typing import Any

from router.parse import ParsedRequest

__all__ = ["Splice", "Trail", "continuation"]

_LIMITS = ("max_tokens", "max_completion_tokens")
# streamed fields that are not plain generated text: a stream carrying them is not continued
_STRUCTURED = ("tool_calls", "function_call", "reasoning_content", "reasoning")
_PLAIN = frozenset({"role", "content"})  # a delta of text alone


def _why_not(p: ParsedRequest) -> str | None:
    """Why ``p``'s stream cannot be continued elsewhere (None: it can)."""
    body = p.body
    if not p.stream:
        return "not streamed"
    if p.api is not None:
        return f"the {p.api} API"
    if p.sequences != 1 or p.other_prompt_tokens:
        return "several choices"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "log probabilities"
    if body.get("echo"):
        return "echo"
    if p.chat:
        last = (body.get("messages") or [None])[-1]
        if body.get("continue_final_message") and not (
            isinstance(last, dict) and isinstance(last.get("content"), str)
        ):
            return "a final message that is not text"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return None
    return None if isinstance(prompt, str) else "a token-id prompt"


class Trail:
    """What one stream has sent its client so far (fed every data event the client gets)."""

    __slots__ = ("created", "finished", "id", "model", "pieces", "tokens", "why_not")

    def __init__(self, p: ParsedRequest) -> None:
        self.why_not = _why_not(p)
        self.id: str | None = None
        self.created: Any = None
        self.model: Any = None
        self.pieces: list[str] = []
        self.tokens = 0
        self.finished = False  # a finish reason was sent: the answer is complete

    @property
    def resumable(self) -> bool:
        return self.why_not is None and not self.finished

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def observe(self, chunk: dict[str, Any]) -> None:
        """A chat or completion chunk the client got."""
        if self.id is None:
            self.id = chunk.get("id")
            self.created, self.model = chunk.get("created"), chunk.get("model")
        choices = chunk.get("choices")
        if not choices:
            return
        if len(choices) != 1:
            self.why_not = "several choices"
            return
        choice = choices[0]
        if choice.get("logprobs"):
            self.why_not = "log probabilities"
        delta = choice.get("delta")
        piece = choice.get("text") if delta is None else delta.get("content")
        if (
            delta is not None
            and not delta.keys() <= _PLAIN  # (the common delta: no look at each key)
            and any(delta.get(k) for k in _STRUCTURED)
        ):
            self.why_not = "tool calls or reasoning"
        if piece:
            self.pieces.append(piece)
            self.tokens += 1
        if choice.get("finish_reason"):
            self.finished = True


def continuation(p: ParsedRequest, trail: Trail) -> bytes | None:
    """The body that asks another engine for the rest of ``p``'s answer after ``trail``; None
    when nothing is left to generate."""
    import orjson  # (a failover's cost, not every request's)

    body: dict[str, Any] = dict(p.body)
    for key in _LIMITS:
        limit = body.get(key)
        if isinstance(limit, int):
            body[key] = limit - trail.tokens
            if body[key] <= 0:
                return None
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = max(0, body["min_tokens"] - trail.tokens)
    text = trail.text
    if p.chat:
        messages = list(body.get("messages") or [])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") and isinstance(last, dict):
            messages[-1] = {**last, "content": last["content"] + text}
        else:
            messages.append({"role": "assistant", "content": text})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        prompt = body.get("prompt")
        body["prompt"] = str(prompt[0] if isinstance(prompt, list) else prompt) + text
    return orjson.dumps(body)


class Splice:
    """A continuation's events, made part of the first stream (see the module's text)."""

    __slots__ = ("before", "p", "trail")

    def __init__(self, p: ParsedRequest, trail: Trail) -> None:
        self.p, self.trail = p, trail
        self.before = trail.tokens  # the tokens the client had when this continuation began

    def rewrite(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """``chunk`` as the client gets it; None: not sent (a role-only first delta)."""
        t = self.trail
        if t.id is not None:
            chunk["id"] = t.id
        if t.created is not None:
            chunk["created"] = t.created
        if t.model is not None:
            chunk["model"] = t.model
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            if delta is not None and "role" in delta:
                del delta["role"]
                if not delta.get("content") and not choice.get("finish_reason"):
                    return None
        usage = chunk.get("usage")
        if usage:
            chunk["usage"] = self._usage(usage)
        return chunk

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation's usage as the whole answer's: its prompt held the text sent before
        (counted as output, once), its output is the rest."""
        before = self.before
        engine_prompt = int(usage.get("prompt_tokens") or 0)
        prompt = self.p.prompt_tokens_total if self.p.exact_tokens else engine_prompt - before
        prompt = max(0, prompt)
        out = before + int(usage.get("completion_tokens") or 0)
        whole: dict[str, Any] = {
            **usage,
            "prompt_tokens": prompt,
            "completion_tokens": out,
            "total_tokens": prompt + out,
        }
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            whole["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(details["cached_tokens"], prompt),
            }
        return whole
