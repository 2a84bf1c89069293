"""Messages and Responses requests made into the chat the engine computes (vLLM's conversion:
``vllm/entrypoints/anthropic``, ``responses_utils``), their usage read in chat keys, and the
simulated engine's answers in each API's shape (checked with the Anthropic SDK's own types)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import orjson
import pytest

from agents.simformats import AnswerFormat
from router.parse import parse_request
from streams.agentapis import (
    MessagesRequest,
    ResponsesRequest,
    event_token,
    event_usage,
    usage_as_chat,
)
from streams.tokenization import TokenizerSpec, load_tokenization
from tests.unit.test_chat_templates import CHATML_TOOLS, TOKENIZER, _reference


def _chat(req: MessagesRequest | ResponsesRequest) -> list[dict[str, Any]]:
    return req.to_chat().template_messages()


def test_a_messages_request_becomes_the_engines_chat() -> None:
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; hash=ab12"},
                {"type": "text", "text": "You are a coding agent."},
            ],
            "messages": [
                {"role": "user", "content": "Fix the bug."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "look first", "signature": "s"},
                        {"type": "text", "text": "Searching."},
                        {"type": "tool_use", "id": "tu1", "name": "grep", "input": {"q": "bug"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "tu1",
                            "content": [
                                {"type": "text", "text": "a.py:3"},
                                {"type": "text", "text": "b.py:9"},
                            ],
                        },
                        {"type": "text", "text": "Continue."},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "tu2", "content": "ok"}],
                },
            ],
            "tools": [
                {"name": "grep", "description": "search", "input_schema": {"type": "object"}}
            ],
        }
    )
    assert _chat(req) == [
        {"role": "system", "content": "You are a coding agent."},  # the per-request line dropped
        {"role": "user", "content": "Fix the bug."},
        {
            "role": "assistant",
            "content": "Searching.",
            "reasoning": "look first",
            "tool_calls": [
                {
                    "id": "tu1",
                    "type": "function",
                    "function": {"name": "grep", "arguments": json.dumps({"q": "bug"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "tu1", "content": "a.py:3\nb.py:9"},  # ahead of its turn
        {"role": "user", "content": "Continue."},
        {"role": "tool", "tool_call_id": "tu2", "content": "ok"},  # a turn of results only
    ]
    chat = req.to_chat()
    assert chat.output_limit(99) == 5
    assert chat.tools == [
        {
            "type": "function",
            "function": {"name": "grep", "description": "search", "parameters": {"type": "object"}},
        }
    ]


def test_a_responses_request_becomes_the_engines_chat() -> None:
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "Be terse.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "List files."}]},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "use ls"}]},
                {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "ls", "arguments": '{"a":1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "a b"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Two files."}],
                },
            ],
            "max_output_tokens": 7,
            "tools": [{"type": "function", "name": "ls", "parameters": {}}, {"type": "web_search"}],
        }
    )
    assert _chat(req) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "List files."},
        {
            "role": "assistant",
            "reasoning": "use ls",  # the tool calls join the assistant message before them
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"a":1}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a b"},
        {"role": "assistant", "content": "Two files."},
    ]
    chat = req.to_chat()
    assert chat.output_limit(99) == 7
    assert chat.tools == [
        {"type": "function", "function": {"type": "function", "name": "ls", "parameters": {}}}
    ]
    plain = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tool_choice": "none"})
    assert _chat(plain) == [{"role": "user", "content": "hi"}]


def test_agent_requests_tokenize_as_the_template_renders_their_chat() -> None:
    """Exact tokens: a Messages request's ids are transformers' rendering of the chat the
    engine makes of it; the router keeps the body, sets its output limit in the API's own
    field and records the API."""
    tk = load_tokenization(TokenizerSpec(tokenizer=TOKENIZER, chat_template=CHATML_TOOLS))
    body = {
        "model": "m",
        "system": "sys",
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "w", "input": {"c": "Paris"}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "9C"}],
            },
        ],
    }
    p = parse_request(orjson.dumps(body), True, 16, lambda _: tk, "messages")
    chat = MessagesRequest.model_validate(body).to_chat()
    reference = {"messages": chat.template_messages(), "add_generation_prompt": True}
    assert p.exact_tokens and p.tokens == _reference(CHATML_TOOLS, reference)
    assert p.body["max_tokens"] == 16 and p.path == "/v1/messages" and p.kind == "messages"
    assert p.include_usage  # nothing to ask the engine for: its streams carry usage
    r = parse_request(
        orjson.dumps({"model": "m", "input": "x"}), True, 16, lambda _: tk, "responses"
    )
    assert r.body["max_output_tokens"] == 16 and "max_tokens" not in r.body
    assert r.path == "/v1/responses"


@pytest.mark.parametrize(
    "body",
    [
        # nothing the model would see
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "unknown"}]}]},
        {"model": "m", "messages": [{"role": "user", "content": 5}]},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    ],
)
def test_a_malformed_messages_request_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        parse_request(orjson.dumps(body), True, 16, api="messages")


def test_usage_and_events_are_read_in_chat_keys() -> None:
    assert usage_as_chat(
        "messages", {"input_tokens": 10, "output_tokens": 2, "cache_read_input_tokens": 8}
    ) == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    assert usage_as_chat(
        "responses",
        {"input_tokens": 4, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 0}},
    ) == {"prompt_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage_as_chat("messages", None) is None
    assert event_token("messages", {"type": "content_block_delta"})
    assert not event_token("messages", {"type": "message_delta"})
    assert event_token("responses", {"type": "response.function_call_arguments.delta"})
    assert event_usage("responses", {"type": "response.output_text.delta"}) is None
    done = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 3, "output_tokens": 2}},
    }
    assert event_usage("responses", done) == {"prompt_tokens": 3, "completion_tokens": 2}


def test_the_simulated_engines_messages_answer_is_the_sdks_message() -> None:
    """The Anthropic SDK's own types take the simulated engine's answer and stream events."""
    usage = {
        "prompt_tokens": 30,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    fmt = AnswerFormat("messages", "msg_1", 0, "m", False)
    message = anthropic.types.Message.model_validate(fmt.whole("hi there", usage))
    assert message.content[0].type == "text" and message.stop_reason == "max_tokens"
    assert message.usage.input_tokens == 30 and message.usage.output_tokens == 2
    raw = fmt.start(30, 16) + fmt.piece("hi", True) + fmt.piece(" there", False) + fmt.end(usage)
    events = [orjson.loads(b.split(b"data: ", 1)[1]) for b in raw.split(b"\n\n") if b]
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for e in events:
        anthropic.types.RawMessageStreamEvent.__args__  # noqa: B018 - the union exists
        typed = {
            "message_start": anthropic.types.RawMessageStartEvent,
            "content_block_start": anthropic.types.RawContentBlockStartEvent,
            "content_block_delta": anthropic.types.RawContentBlockDeltaEvent,
            "content_block_stop": anthropic.types.RawContentBlockStopEvent,
            "message_delta": anthropic.types.RawMessageDeltaEvent,
            "message_stop": anthropic.types.RawMessageStopEvent,
        }[e["type"]]
        typed.model_validate(e)
