"""Turning a request into token ids the way the engine does.

With a model's tokenizer configured (:class:`TokenizerSpec`: an HF ``tokenizer.json`` and the
model's chat template), the router tokenizes exactly like vLLM does. Chat requests: the template
rendered by transformers' ``apply_chat_template`` — the same call vLLM makes, so ``strftime_now``,
loop controls, ``tojson``, ``tools``, ``chat_template_kwargs`` (e.g. ``enable_thinking``),
``add_generation_prompt`` and ``continue_final_message`` behave as in the engine — then encoded
without special tokens (the template carries them). Completion requests: the prompt encoded with
special tokens. Its block hashes are then the engine's, block for block. Without a tokenizer, both
the router and the simulated engine fall back to 4-byte text chunks
(:func:`streams.blocks.approx_tokenize`), which decisions mark as approximate.

A tokenizer file is named ``file:/path/tokenizer.json`` or ``package:<package>/<resource>`` (a
file shipped inside an installed Python package); nothing is downloaded at run time.
"""

from __future__ import annotations

import functools
import importlib
import importlib.resources
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from streams.blocks import approx_tokenize, detokenize_approx
from streams.openai import ChatRequest, render_chat

__all__ = [
    "APPROXIMATE",
    "Tokenization",
    "TokenizerSpec",
    "load_tokenization",
    "read_source",
    "token_text",
]


class TokenizerSpec(BaseModel):
    """One model's tokenizer and chat template."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokenizer: str = Field(
        min_length=1, description="file:/path/tokenizer.json or package:<package>/<resource>"
    )
    chat_template: str | None = Field(
        default=None,
        description="the model's Jinja chat template (as in its tokenizer_config.json)",
    )
    chat_template_file: str | None = Field(
        default=None,
        description="file:/package: a .jinja template, or a tokenizer_config.json holding one",
    )
    bos_token: str = ""
    eos_token: str = ""


@dataclass(frozen=True)
class Tokenization:
    """How one model's requests become token ids."""

    encode_prompt: Callable[[str], list[int]]  # a completion prompt
    encode_chat: Callable[[ChatRequest], list[int]]
    decode: Callable[[Sequence[int]], str]
    exact: bool  # False: approximate (text chunks), marked so in decision records
    vocab_size: int = 1 << 32


def _approx_chat(req: ChatRequest) -> list[int]:
    """The fallback template, approximately tokenized. ``continue_final_message``: the final
    message's header closes the rendered part and its text follows from a token boundary, so a
    conversation continued with the text generated so far tokenizes as the first request's
    prompt plus that output (the simulated engine's output words are whole tokens)."""
    if req.continue_final_message and req.messages:
        *head, last = req.messages
        rendered = render_chat(head, f"<|{last.role}|>\n")
        return approx_tokenize(rendered) + approx_tokenize(last.text())
    tail = "<|assistant|>\n" if req.add_generation_prompt else ""
    return approx_tokenize(render_chat(req.messages, tail))


APPROXIMATE = Tokenization(
    encode_prompt=approx_tokenize,
    encode_chat=_approx_chat,
    decode=detokenize_approx,
    exact=False,
)


def read_source(source: str) -> bytes:
    """The bytes of ``file:PATH`` or ``package:PKG/RESOURCE`` (a plain path counts as a file)."""
    kind, _, rest = source.partition(":")
    if kind == "package" and rest:
        package, _, resource = rest.partition("/")
        if not resource:
            raise ValueError(f"{source!r}: expected package:<package>/<resource>")
        try:
            return importlib.resources.files(package).joinpath(resource).read_bytes()
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            raise ValueError(f"{source!r}: {exc}") from exc
    path = Path(rest if kind == "file" and rest else source)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{source!r}: {exc}") from exc


def _template(spec: TokenizerSpec) -> tuple[str | None, str, str]:
    template, bos, eos = spec.chat_template, spec.bos_token, spec.eos_token
    if template is None and spec.chat_template_file:
        raw = read_source(spec.chat_template_file)
        if spec.chat_template_file.endswith(".json"):  # a tokenizer_config.json
            cfg = json.loads(raw)
            template = cfg.get("chat_template")
            if isinstance(template, list):  # several named templates: the default one
                named = {t.get("name"): t.get("template") for t in template}
                template = named.get("default") or next(iter(named.values()), None)
            bos = bos or token_text(cfg.get("bos_token"))
            eos = eos or token_text(cfg.get("eos_token"))
        else:
            template = raw.decode()
    return template, bos, eos


def token_text(v: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return str(v or "")


def _hf_renderer(template: str, bos: str, eos: str) -> Callable[[ChatRequest], str]:
    """A chat request rendered by transformers' ``apply_chat_template``, as vLLM calls it.
    Rendering to text reads the template and the special tokens' text, never the vocabulary:
    transformers gets a one-word tokenizer (it deep-copies the one it is given, which for a
    large vocabulary is gigabytes)."""
    from tokenizers import Tokenizer, models

    tf: Any = importlib.import_module("transformers")
    tf.utils.logging.set_verbosity_error()  # "no PyTorch found": nothing here needs it
    unknown = "<unk>"
    stub = Tokenizer(models.WordLevel({unknown: 0}, unk_token=unknown))
    hf: Any = tf.PreTrainedTokenizerFast(
        tokenizer_object=stub, bos_token=bos or None, eos_token=eos or None
    )
    hf.chat_template = template

    def render(req: ChatRequest) -> str:
        try:
            text = hf.apply_chat_template(
                req.template_messages(),
                tools=req.tools,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tokenize=False,
                **(req.chat_template_kwargs or {}),
            )
        except Exception as exc:  # the template refused the conversation (raise_exception…)
            raise ValueError(f"chat template: {exc}") from exc
        return str(text)

    return render


@functools.cache
def load_tokenization(spec: TokenizerSpec | None) -> Tokenization:
    """The tokenization of ``spec`` (cached per spec); :data:`APPROXIMATE` for None."""
    if spec is None:
        return APPROXIMATE
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(read_source(spec.tokenizer).decode())
    except Exception as exc:
        raise ValueError(f"cannot load tokenizer {spec.tokenizer!r}: {exc}") from exc
    template_text, bos, eos = _template(spec)

    def ids(text: str, special: bool) -> list[int]:
        # the batch call without offsets: the same ids as ``encode`` for ~2/3 of its CPU on a
        # long prompt (offsets are what nothing here reads), and ``.ids`` is a fresh list
        encoded: list[int] = tok.encode_batch_fast([text], add_special_tokens=special)[0].ids
        return encoded

    def encode_prompt(text: str) -> list[int]:
        return ids(text, True)

    render: Callable[[ChatRequest], str] = (
        (lambda req: render_chat(req.messages))
        if template_text is None
        else _hf_renderer(template_text, bos, eos)
    )

    def encode_chat(req: ChatRequest) -> list[int]:
        return ids(render(req), False)

    vocab = tok.get_vocab_size()

    def decode(ids: Sequence[int]) -> str:
        # the simulated engine's output ids are its own: fold them into the vocabulary
        return str(tok.decode([i % vocab for i in ids], skip_special_tokens=True))

    return Tokenization(encode_prompt, encode_chat, decode, True, vocab)
