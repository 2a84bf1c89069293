"""The agent APIs through the router: Anthropic's Messages (``/v1/messages``, driven by the
Anthropic SDK, which parses the stream and the answer itself) and OpenAI's Responses
(``/v1/responses``), admitted, routed as the chat the engine makes of them and accounted like
chat: each session's turns go to its home, the engine finds the earlier turns' prefix there
(cached tokens in the API's own usage), and the records name the API."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx
import orjson

from streams.codec import decode
from streams.schemas import Outcome
from streams.topics import OUTCOMES
from tests.edgekit import ADMIN, MODEL, Edge, bearer, edge

TOOL = {"name": "grep", "description": "search the tree", "input_schema": {"type": "object"}}


def _turns(n: int) -> list[list[dict[str, Any]]]:
    """The Messages conversations of a coding agent's ``n`` turns: each the last one plus the
    model's tool call and the tool's result."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Find where the cache is flushed. " + "context " * 80}
    ]
    out = [list(messages)]
    for i in range(1, n):
        messages = [
            *messages,
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Looking ({i})."},
                    {"type": "tool_use", "id": f"t{i}", "name": "grep", "input": {"q": f"q{i}"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"t{i}", "content": "hit " * 60},
                    {"type": "text", "text": "go on"},
                ],
            },
        ]
        out.append(list(messages))
    return out


async def test_messages_sessions_hit_their_home_through_the_anthropic_sdk() -> None:
    """Three agents of four turns each, interleaved, over the Anthropic SDK (``x-api-key``,
    ``metadata.user_id``): every turn of an agent lands on one node, every turn after the first
    reads the earlier turns from the engine's cache, streamed or not. (Tenants' caches are not
    kept apart here: the engines' Messages API takes no cache_salt.)"""
    async with edge(engines=4, router={"cache_isolation": "off"}) as e:
        client = anthropic.AsyncAnthropic(
            base_url=e.url,
            api_key="sk-alpha",
            max_retries=0,
            http_client=httpx.AsyncClient(
                base_url=e.url
            ),  # (this SDK's own one predates httpx 0.28)
        )
        cached: dict[str, list[int]] = {}
        for turn in range(4):
            for agent in ("a", "b", "c"):
                messages = _turns(4)[turn]
                system = f"You are agent {agent}. " + "rules " * 40
                args: dict[str, Any] = {
                    "model": MODEL,
                    "max_tokens": 4,
                    "system": system,
                    "messages": messages,
                    "tools": [TOOL],
                    "metadata": {"user_id": f"agent-{agent}"},
                }
                if agent == "b":  # streamed: the SDK reads the events and their usage
                    async with client.messages.stream(**args) as stream:
                        message = await stream.get_final_message()
                else:
                    message = await client.messages.create(**args)
                assert message.type == "message" and message.content[0].type == "text"
                assert message.usage.output_tokens == 4
                read = (message.usage.model_extra or {}).get("cache_read_input_tokens")
                cached.setdefault(agent, []).append(int(read or 0))
        await client.close()
        decisions = e.decisions()
        assert {d.endpoint_kind for d in decisions} == {"messages"}
        for agent in ("a", "b", "c"):
            mine = [d for d in decisions if d.session_id == f"agent-{agent}"]
            assert len(mine) == 4 and len({d.chosen_node for d in mine}) == 1, mine
            assert all(c > 0 for c in cached[agent][1:]), cached
        _accounted(e, sorted(c for v in cached.values() for c in v), 4)
        assert await e.reservations() == 0


def _accounted(e: Edge, cached: list[int], output_tokens: int) -> None:
    """The router's outcomes count what the engine reported to the client."""
    outcomes = [decode(Outcome, v) for v in e.published(OUTCOMES.suffix)]
    assert sorted(o.cached_tokens or 0 for o in outcomes) == cached
    assert {o.output_tokens for o in outcomes} == {output_tokens}
    assert all(o.status == "ok" and o.prompt_tokens > 0 for o in outcomes)


async def _responses(e: Edge, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """A streamed Responses request's status and its events (``event:``/``data:`` pairs)."""
    async with e.http.post(e.url + "/v1/responses", json=body, headers=bearer("sk-beta")) as r:
        raw = await r.read()
    events = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            event = orjson.loads(lines["data"])
            assert lines.get("event") == event["type"]  # the SSE name is the event's type
            events.append(event)
    return r.status, events


async def test_responses_sessions_hit_their_home() -> None:
    """Responses turns with tool calls and their outputs (``prompt_cache_key`` names the
    session): one node per session, the engine's cached tokens in ``response.*`` usage, the
    router's outcome counting the same, whole and streamed. The tenant's cache salt reaches
    the engine (its Responses API takes one)."""
    async with edge(engines=4) as e:
        reads: dict[str, list[int]] = {}
        for turn in range(3):
            for key in ("s1", "s2"):
                items: list[dict[str, Any]] = [
                    {"role": "user", "content": [{"type": "input_text", "text": "fix " * 90}]}
                ]
                for i in range(turn):
                    items += [
                        {
                            "type": "function_call",
                            "call_id": f"c{i}",
                            "name": "ls",
                            "arguments": "{}",
                        },
                        {"type": "function_call_output", "call_id": f"c{i}", "output": "f " * 50},
                    ]
                body = {
                    "model": MODEL,
                    "instructions": f"session {key} " + "be terse " * 30,
                    "input": items,
                    "max_output_tokens": 3,
                    "prompt_cache_key": key,
                }
                if key == "s1":
                    status, events = await _responses(e, {**body, "stream": True})
                    assert status == 200, events
                    kinds = [ev["type"] for ev in events]
                    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
                    assert kinds.count("response.output_text.delta") == 3
                    usage = events[-1]["response"]["usage"]
                else:
                    status, out, _ = await e.call("POST", "/v1/responses", body, bearer("sk-beta"))
                    assert status == 200 and out["object"] == "response", out
                    usage = out["usage"]
                assert usage["output_tokens"] == 3
                assert e.decisions()[-1].endpoint_kind == "responses"
                reads.setdefault(key, []).append(usage["input_tokens_details"]["cached_tokens"])
        decisions = e.decisions()
        assert {d.endpoint_kind for d in decisions} == {"responses"}
        for key in ("s1", "s2"):
            mine = [d for d in decisions if d.session_id == key]
            assert len(mine) == 3 and len({d.chosen_node for d in mine}) == 1, mine
            assert all(c > 0 for c in reads[key][1:]), reads
        _accounted(e, sorted(c for v in reads.values() for c in v), 3)
        assert await e.reservations() == 0


async def test_agent_api_refusals_say_why() -> None:
    """A malformed body is a 400 naming the field before anything is reserved; a bad key is a
    401 in either header; where tenants' caches are kept apart, a Messages request is a 400
    saying why (the engine could not keep them apart)."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    async with edge() as e:
        status, out, _ = await e.call("POST", "/v1/messages", body, {"x-api-key": "sk-alpha"})
        assert status == 400 and "cache_salt" in out["error"]["message"], out
        refused = e.decisions()[-1]
        assert refused.admission_reason == "isolation_unsupported", refused
        assert refused.endpoint_kind == "messages" and refused.chosen_node is None
    async with edge(router={"cache_isolation": "off"}) as e:
        for path, bad in (
            ("/v1/messages", {"model": MODEL, "messages": []}),
            ("/v1/messages", {"model": MODEL, "messages": [{"role": "user"}]}),
            ("/v1/responses", {"model": MODEL, "input": ""}),
            ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 0}),
        ):
            status, out, _ = await e.call("POST", path, bad, bearer("sk-alpha"))
            assert status == 400 and out["error"]["message"], (path, bad, out)
        status, _, _ = await e.call("POST", "/v1/messages", body, {"x-api-key": "sk-nobody"})
        assert status == 401
        status, out, _ = await e.call("POST", "/v1/messages", body, {"x-api-key": "sk-alpha"})
        assert status == 200, out
        assert await e.reservations() == 0


async def test_responses_keep_tenants_caches_apart() -> None:
    """One engine: a tenant's second identical Responses request reads its first from the
    cache, another tenant's does not (the router's salt reaches the engine's Responses API)."""
    body = {"model": MODEL, "input": "same prompt " * 60, "max_output_tokens": 2}
    async with edge(engines=1) as e:
        cached = []
        for key in ("sk-beta", "sk-beta", "sk-alpha"):
            status, out, _ = await e.call("POST", "/v1/responses", body, bearer(key))
            assert status == 200, out
            cached.append(out["usage"]["input_tokens_details"]["cached_tokens"])
        assert cached[1] > 0 and cached[2] == 0, cached


async def test_agent_requests_stay_exact_under_the_tokenizer_checks() -> None:
    """With the model's tokenizer and a check on every request, Messages and Responses requests
    are tokenized exactly and never sent to the engine's /tokenize (it takes chat and
    completion bodies: an Anthropic body there would read as a mismatch and mark the model
    approximate); chat requests are still checked."""
    from streams.tokenization import TokenizerSpec
    from tests.unit.test_chat_templates import CHATML_TOOLS, TOKENIZER

    spec = TokenizerSpec(tokenizer=TOKENIZER, chat_template=CHATML_TOOLS)
    router = {
        "tokenizers": {MODEL: spec},
        "tokenize_check_every": 1,
        "tokenize_check_min": 1,
        "cache_isolation": "off",
    }
    async with edge(engines=1, engine={"tokenizer": spec}, router=router) as e:
        asks = [
            ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": _turns(2)[1]}),
            ("/v1/responses", {"model": MODEL, "input": "hello " * 30, "max_output_tokens": 2}),
            (
                "/v1/chat/completions",
                {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
            ),
        ]
        for path, body in asks:
            status, out, _ = await e.call("POST", path, body, bearer("sk-alpha"))
            assert status == 200, out
            await asyncio.sleep(0.2)  # a check runs beside its request
        _, state, _ = await e.call("GET", "/v1/kvgate/state", headers=bearer(ADMIN))
        report = state["tokenization_checks"][MODEL]
        assert report["checks"] == 1 and report["mismatches"] == 0 and not report["approximate"]
        assert [d.approximate_tokens for d in e.decisions()] == [False, False, False]
