"""An OpenAI request body → what routing needs (validated, tokenized)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace
from hashlib import blake2b
from typing import Any

import orjson

from streams.agentapis import API_PATHS, LIMIT_FIELD, Api, MessagesRequest, ResponsesRequest
from streams.openai import ChatRequest, CompletionRequest
from streams.tokenization import APPROXIMATE, Tokenization

__all__ = ["ParsedRequest", "as_token_ids", "common_prefix", "parse_request", "request_session"]


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
    exact_tokens: bool = False  # tokenized with the model's own tokenizer
    min_tokens: int = 0
    ignore_eos: bool = False  # the engine generates max_tokens, whatever it learned
    sequences: int = 1  # n / best_of
    cache_salt: str | None = None  # hashes are chained from it (streams.blocks.chain_root)
    # tokens that may be hashed and claimed as hits: all of them, except in a request with
    # images (or other media), whose blocks past the first one the router cannot reproduce
    hashable_tokens: int | None = None
    other_prompt_tokens: int = 0  # the other prompts of a batched completion (not routed by)
    tokens_digest: bytes = b""  # of ``tokens`` (made with them, off the loop for a long prompt)
    api: Api | None = None  # None: chat or completions, as ``chat`` says
    parent_session_id: str | None = None  # a subagent's parent session (header or metadata)

    @property
    def kind(self) -> Api:
        """Which API the request came in by (and goes to the engine by)."""
        return self.api or ("chat" if self.chat else "completions")

    @property
    def prompt_tokens_total(self) -> int:
        """Prompt tokens the engine computes for the whole request (every prompt of a batch)."""
        return len(self.tokens) + self.other_prompt_tokens

    @property
    def hashable(self) -> list[int]:
        return self.tokens if self.hashable_tokens is None else self.tokens[: self.hashable_tokens]

    @property
    def path(self) -> str:
        return API_PATHS[self.kind]


MAX_JSON_DEPTH = 64  # nesting of a request body; orjson's own limit (1,024) is far past safe


def _depth_ok(body: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``body`` nests at most ``limit`` levels (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))
    return True


def parse_request(
    raw: bytes,
    chat: bool,
    default_max_tokens: int,
    tokenization: Callable[[str], Tokenization] = lambda _: APPROXIMATE,
    api: Api | None = None,
) -> ParsedRequest:
    """Raises ``orjson.JSONDecodeError``, ``pydantic.ValidationError`` or ``ValueError`` (→ 400).
    ``tokenization`` gives the model's tokenization (by model name); ``api``: ``messages`` or
    ``responses`` for the agent APIs (``chat`` True), tokenized as the chat the engine makes of
    them (streams/agentapis.py)."""
    body = orjson.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")  # noqa: TRY004 - a 400
    if not _depth_ok(body):
        raise ValueError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    if "kv_transfer_params" in body:
        # an engine with a KV connector would pull KV from wherever these say: only kvgate's
        # disaggregated-prefill path sets them
        raise ValueError("kv_transfer_params is set by kvgate, not by clients")
    if "agent_hint" in body:  # a retention hint pins KV on the engine: kvgate's to give
        body = {k: v for k, v in body.items() if k != "agent_hint"}
    req: ChatRequest | CompletionRequest
    given_ids = False
    kind: Api = api or ("chat" if chat else "completions")
    agent: MessagesRequest | ResponsesRequest | None = None
    if kind == "messages":
        agent = MessagesRequest.model_validate(body)
    elif kind == "responses":
        agent = ResponsesRequest.model_validate(body)
    if chat:
        req = agent.to_chat() if agent is not None else ChatRequest.model_validate(body)
        other_prompts = 0
        tk = tokenization(req.model)
        if req.has_media:
            # the engine puts the media's own tokens (and hashes) where a part is: rendered with
            # two different stand-ins, the ids agree up to the first media part. A margin keeps
            # off the boundary, where the text before it may tokenize differently next to the
            # engine's placeholder than next to a stand-in.
            tokens = tk.encode_chat(req.media_as(_MEDIA_A))
            other = tk.encode_chat(req.media_as(_MEDIA_B))
            hashable: int | None = max(0, common_prefix(tokens, other) - _MEDIA_MARGIN)
        else:
            tokens, hashable = tk.encode_chat(req), None
    else:
        req = CompletionRequest.model_validate(body)
        tk = tokenization(req.model)
        hashable = None
        # a batch runs on one engine: routed by its first prompt, admitted for all of them
        prompts = req.prompt_list(tk.encode_prompt)
        tokens, other_prompts = prompts[0], sum(len(x) for x in prompts[1:])
        given_ids = req.prompt_text() is None  # token ids: exact whatever the tokenizer
    if req.given_limit is None:
        # the engine generates no more than the reservation was sized for: the router's
        # default becomes the request's limit (docs/operations.md, "Reservation size")
        body = {**body, LIMIT_FIELD[kind]: default_max_tokens}
    return ParsedRequest(
        body=body,
        model=req.model,
        stream=agent.stream if agent is not None else req.stream,
        # the agent APIs report usage in every stream (nothing to ask for, nothing to drop)
        include_usage=agent is not None
        or bool(req.stream_options and req.stream_options.include_usage),
        tokens=tokens,
        max_tokens=req.output_limit(default_max_tokens),
        chat=chat,
        session_id=bounded_id(request_session(body)),
        parent_session_id=bounded_id(_parent_session(body)),
        exact_tokens=(tk.exact or (not chat and given_ids)) and hashable is None,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        sequences=req.sequences * (req.batch if isinstance(req, CompletionRequest) else 1),
        other_prompt_tokens=other_prompts,
        cache_salt=req.cache_salt,
        hashable_tokens=hashable,
        tokens_digest=tokens_digest(tokens),
        api=api,
    )


def as_token_ids(p: ParsedRequest) -> ParsedRequest:
    """``p`` with its text prompt replaced by the router's token ids, for an engine that takes
    them (vLLM's and SGLang's ``/v1/completions``): the engine does not tokenize the prompt
    again. Only a completion of one text prompt tokenized exactly; anything else as it is (the
    caller knows whether the engine's tokenizer agrees with the router's)."""
    if p.chat or p.api is not None or not p.exact_tokens or p.other_prompt_tokens:
        return p
    if not isinstance(p.body.get("prompt"), str) or not p.tokens:
        return p
    return replace(p, body={**p.body, "prompt": p.tokens})


def tokens_digest(tokens: list[int]) -> bytes:
    """A digest of ``tokens``, converted a slice at a time (no long hold of the interpreter)."""
    h = blake2b(digest_size=16)
    for i in range(0, len(tokens), 1 << 16):
        h.update(array("I", tokens[i : i + (1 << 16)]).tobytes())
    return h.digest()


_MEDIA_A, _MEDIA_B = "<media:a>", "<media:b>"
_MEDIA_MARGIN = 8  # tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


MAX_ID_CHARS = 256  # a client's identifier kept as given up to this; beyond, its digest


def bounded_id(value: Any) -> str | None:
    """A client-chosen identifier (``user``, ``session_id``) as kvgate keeps and records it:
    itself up to :data:`MAX_ID_CHARS`, else a digest of it (the same value, the same digest)."""
    if value is None:
        return None
    text = str(value)
    if len(text) <= MAX_ID_CHARS:
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()


def _parent_session(body: dict[str, Any]) -> str | None:
    """A subagent's parent session from the body (``metadata.parent_session_id``)."""
    meta = body.get("metadata")
    sid = meta.get("parent_session_id") if isinstance(meta, dict) else None
    return (
        str(sid) if isinstance(sid, str | int) and not isinstance(sid, bool) and sid != "" else None
    )


def request_session(body: dict[str, Any]) -> str | None:
    """A session key from the body, the most specific first: ``session_id``,
    ``prompt_cache_key`` (OpenAI's key for requests that share a prefix), ``metadata.session_id``,
    ``metadata.user_id`` (Anthropic's), ``user`` (OpenAI's: an end user, who may run several
    sessions); None when there is none. A session header outranks
    them all (router/flow/intake.py)."""
    meta = body.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
    for sid in (
        body.get("session_id"),
        body.get("prompt_cache_key"),
        meta.get("session_id"),
        meta.get("user_id"),
        body.get("user"),
    ):
        if sid is not None and sid != "" and not isinstance(sid, (dict, list)):
            return str(sid)
    return None
