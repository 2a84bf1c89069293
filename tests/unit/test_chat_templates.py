"""Chat templates rendered the way the engine renders them: golden tests against transformers'
``apply_chat_template`` (what vLLM calls), on templates that use what real models' templates
use — tools and ``tojson``, ``strftime_now``, loop controls, ``chat_template_kwargs``,
``continue_final_message``, tool calls. kvgate's token ids must equal the reference's."""

from __future__ import annotations

import importlib.resources
from typing import Any

import orjson
import pytest

from router.parse import parse_request
from streams.openai import ChatRequest
from streams.tokenization import TokenizerSpec, load_tokenization

TOKENIZER = "package:anthropic/tokenizer.json"

CHATML_TOOLS = """{%- if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls is defined %}{% for c in m.tool_calls %}\
<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\
{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA32_DATED = """{{- bos_token }}<|start_header_id|>system<|end_header_id|>

Cutting Knowledge Date: December 2023
Today Date: {{ strftime_now("%d %b %Y") }}

{% if messages[0].role == 'system' %}{{ messages[0].content | trim }}{% endif %}<|eot_id|>
{%- for m in messages %}{% if m.role != 'system' %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content | trim }}<|eot_id|>{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

LOOP_CONTROLS = """{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\
{% if loop.index > 4 %}{% break %}{% endif %}[{{ loop.index }}:{{ m.role }}] {{ m.content }}
{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"""

THINKING = """{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}\
{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and \
enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

CONTINUE = """{% for m in messages %}<|{{ m.role }}|>
{{ m.content }}<|end|>
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <today> & 'tomorrow'",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CASES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "chatml_tools",
        CHATML_TOOLS,
        {
            "messages": [
                {"role": "user", "content": "What is the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "<Paris>"}},
                        }
                    ],
                },
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            ],
            "tools": TOOLS,
        },
    ),
    (
        "llama32_dated",
        LLAMA32_DATED,
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hello!"},
            ]
        },
    ),
    (
        "loop_controls",
        LOOP_CONTROLS,
        {
            "messages": [{"role": "system", "content": "s"}]
            + [{"role": "user", "content": f"turn {i}"} for i in range(7)]
        },
    ),
    (
        "thinking_off",
        THINKING,
        {
            "messages": [{"role": "user", "content": "2+2?"}],
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ),
    (
        "continue_final_message",
        CONTINUE,
        {
            "messages": [
                {"role": "user", "content": "Write a haiku."},
                {"role": "assistant", "content": "Autumn moonlight -"},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ),
]


def _reference(template: str, body: dict[str, Any]) -> list[int]:
    """What transformers makes of the same request (vLLM's call: render, then encode without
    special tokens)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = importlib.resources.files("anthropic").joinpath("tokenizer.json").read_text()
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(raw))  # type: ignore[no-untyped-call]
    hf.chat_template = template
    text = hf.apply_chat_template(
        body["messages"],
        tools=body.get("tools"),
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        tokenize=False,
        **body.get("chat_template_kwargs", {}),
    )
    return list(hf.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(("name", "template", "body"), CASES, ids=[c[0] for c in CASES])
def test_kvgate_renders_like_transformers(name: str, template: str, body: dict[str, Any]) -> None:
    spec = TokenizerSpec(tokenizer=TOKENIZER, chat_template=template)
    tk = load_tokenization(spec)
    p = parse_request(orjson.dumps({"model": "m", **body}), True, 16, lambda _: tk)
    assert p.exact_tokens and p.tokens == _reference(template, body)


def test_what_the_templates_see() -> None:
    """The features are really exercised (not rendered away)."""
    tk = load_tokenization(TokenizerSpec(tokenizer=TOKENIZER, chat_template=CHATML_TOOLS))
    body = CASES[0][2]
    p = parse_request(orjson.dumps({"model": "m", **body}), True, 16, lambda _: tk)
    text = tk.decode(p.tokens)
    assert "get_weather" in text and "<Paris>" in text and "<today>" in text  # tojson: no escapes
    dated = load_tokenization(TokenizerSpec(tokenizer=TOKENIZER, chat_template=LLAMA32_DATED))
    import time

    p = parse_request(orjson.dumps({"model": "m", **CASES[1][2]}), True, 16, lambda _: dated)
    assert time.strftime("%d %b %Y") in dated.decode(p.tokens)
    think = load_tokenization(TokenizerSpec(tokenizer=TOKENIZER, chat_template=THINKING))
    on = parse_request(
        orjson.dumps({"model": "m", **CASES[3][2], "chat_template_kwargs": {}}),
        True,
        16,
        lambda _: think,
    )
    off = parse_request(orjson.dumps({"model": "m", **CASES[3][2]}), True, 16, lambda _: think)
    assert "<think>" in think.decode(off.tokens) and "<think>" not in think.decode(on.tokens)


def test_template_options_are_validated() -> None:
    tk = load_tokenization(TokenizerSpec(tokenizer=TOKENIZER, chat_template=CONTINUE))
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for bad in (
        {"add_generation_prompt": True, "continue_final_message": True},
        {"chat_template_kwargs": {"messages": []}},
    ):
        with pytest.raises(ValueError):
            parse_request(orjson.dumps({**base, **bad}), True, 16, lambda _: tk)


@pytest.mark.parametrize("exact", [True, False])
def test_a_request_with_an_image_claims_no_block_past_it(exact: bool) -> None:
    """The router cannot reproduce the engine's image tokens and hashes: it hashes the prompt up
    to the first media part only (so two requests that differ only after the image share their
    blocks, and a text-only request never lends its later blocks), and says it is approximate."""
    from streams.blocks import chain_hashes
    from streams.tokenization import APPROXIMATE

    tk = (
        load_tokenization(TokenizerSpec(tokenizer=TOKENIZER, chat_template=CHATML_TOOLS))
        if exact
        else APPROXIMATE
    )
    before = "You describe pictures for the kvgate catalogue, plainly and briefly. " * 12
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}

    def chat(*parts: dict[str, Any]) -> bytes:
        body = {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}
        return orjson.dumps(body)

    text = {"type": "text", "text": before}
    p1 = parse_request(
        chat(text, image, {"type": "text", "text": "What is it?"}), True, 8, lambda _: tk
    )
    p2 = parse_request(
        chat(text, image, {"type": "text", "text": "Colours?"}), True, 8, lambda _: tk
    )
    plain = parse_request(
        chat(text, {"type": "text", "text": "What is it?"}), True, 8, lambda _: tk
    )
    assert p1.hashable_tokens is not None and not p1.exact_tokens
    assert plain.hashable_tokens is None and plain.exact_tokens == exact
    h1, h2 = chain_hashes(p1.hashable, 16), chain_hashes(p2.hashable, 16)
    assert len(h1) >= 4 and h1 == h2  # the text before the image: shared blocks
    full = chain_hashes(plain.tokens, 16)
    assert full[: len(h1)] == h1  # which a text-only request with that text has too
    assert len(h1) * 16 <= len(tk.encode_chat(ChatRequest.model_validate(orjson.loads(chat(text)))))


def test_a_large_vocabulary_tokenizer_loads_without_a_copy(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer is loaded once and never deep-copied (transformers copies the tokenizer it is
    handed: for a vocabulary of a few hundred thousand tokens that was a 16 GB allocation)."""
    import copy

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(300_000)} | {"<unk>": 300_000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.to_str())
    copied: list[int] = []
    real = copy.deepcopy

    def spy(x: Any, memo: Any = None) -> Any:
        if isinstance(x, Tokenizer):
            copied.append(x.get_vocab_size())
        return real(x, memo)

    monkeypatch.setattr(copy, "deepcopy", spy)
    tk = load_tokenization(TokenizerSpec(tokenizer=str(path), chat_template=CONTINUE))
    assert tk.vocab_size == 300_001 and all(n < 100 for n in copied), copied
    body = {"model": "m", "messages": [{"role": "user", "content": "w7 w299999"}]}
    p = parse_request(orjson.dumps(body), True, 16, lambda _: tk)
    assert p.exact_tokens and 7 in p.tokens and 299_999 in p.tokens


def test_a_long_prompt_encodes_as_transformers_does() -> None:
    """The router's fast path (no offsets) gives transformers' ids on a long, mixed prompt:
    code, CJK, emoji, runs of whitespace, special-token text and a template around it."""
    import random

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(7)
    pieces = ["def f(x):\n    return x", "数据 缓存", "🙂🚀", "   \t\n\n", "<EOT>", "naïve café"]
    text = "".join(rng.choice(pieces) + " " * rng.randrange(3) for _ in range(8000))
    raw = importlib.resources.files("anthropic").joinpath("tokenizer.json").read_text()
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(raw))  # type: ignore[no-untyped-call]
    tk = load_tokenization(TokenizerSpec(tokenizer=TOKENIZER, chat_template=CONTINUE))
    assert tk.encode_prompt(text) == list(hf.encode(text, add_special_tokens=True))
    body = {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
    p = parse_request(orjson.dumps({"model": "m", **body}), True, 16, lambda _: tk)
    assert len(p.tokens) > 20_000 and p.tokens == _reference(CONTINUE, body)
