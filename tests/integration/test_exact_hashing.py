"""Engine-exact prefix hashing on a real tokenizer (the HF ``tokenizer.json`` that ships inside
the ``anthropic`` 0.34 package; nothing is downloaded): the router tokenizes chat, completion,
Messages and Responses requests like the engine, so every full block of a served prompt is found
in the index under the router's own hashes. A router without the tokenizer (approximate text
chunks) finds none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.openai import ChatMessage, ChatRequest
from streams.settings import KafkaSettings
from streams.tokenization import TokenizerSpec, load_tokenization, read_source
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, get, post

pytestmark = pytest.mark.integration

# ChatML, as Qwen's and many other models' tokenizer_config.json carry it
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPEC = TokenizerSpec(tokenizer="package:anthropic/tokenizer.json", chat_template=CHATML)


def test_tokenization_is_the_models() -> None:
    tk = load_tokenization(SPEC)
    assert tk.exact and tk.vocab_size > 60_000
    text = "KV-cache-aware routing sends a request where its prefix is cached."
    ids = tk.encode_prompt(text)
    assert tk.decode(ids) == text
    assert len(ids) < len(text) / 2  # real subword tokens, not 4-byte chunks
    chat = tk.encode_chat(ChatRequest(model="m", messages=[ChatMessage(role="user", content=text)]))
    assert chat[: len(tk.encode_prompt("<|im_start|>user"))] == tk.encode_prompt("<|im_start|>user")
    with pytest.raises(ValueError, match=r"no_such\.json"):
        load_tokenization(TokenizerSpec(tokenizer="package:anthropic/no_such.json"))


async def test_router_and_engine_agree_block_for_block(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    spec = SPEC.model_dump(exclude_none=True)
    supervisor.env["KVGATE_ENGINE__TOKENIZER"] = json.dumps(spec)
    c = Cluster(supervisor)
    c.add_engine("n1")
    c.add_worker()
    supervisor.env["KVGATE_ROUTER__TOKENIZERS"] = json.dumps({MODEL: spec})
    exact = c.add_router("exact")
    supervisor.env["KVGATE_ROUTER__TOKENIZERS"] = "{}"
    approx = c.add_router("approx")
    await c.wait_ready("exact", 1)
    await c.wait_ready("approx", 1)
    system = "You are the support assistant of kvgate. " * 30
    requests: list[tuple[str, dict[str, Any]]] = [
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "How do I tune the prefill weight?"},
                ],
                "max_tokens": 4,
            },
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": system + "Question: what is a KV block?", "max_tokens": 4},
        ),
    ]
    question = "How do I tune the prefill weight?"
    requests += [  # the agent APIs: the engine hashes the chat it makes of them, as the router
        (
            "/v1/messages",
            {
                "model": MODEL,
                "system": [{"type": "text", "text": system}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}],
                "max_tokens": 4,
            },
        ),
        (
            "/v1/responses",
            {"model": MODEL, "instructions": system, "input": question, "max_output_tokens": 4},
        ),
    ]
    for path, body in requests:
        status, _ = await post(exact, path, body)
        assert status == 200
        api = path.rsplit("/", 1)[1]
        decide = "/v1/kvgate/decide" + (f"?api={api}" if api in ("messages", "responses") else "")

        async def all_blocks_hit(
            body: dict[str, Any] = body, decide: str = decide
        ) -> dict[str, Any] | None:
            _, d = await post(exact, decide, body)
            hit = {c["node_id"]: c["hit_blocks"] for c in d["candidates"]}
            return d if d["prompt_blocks"] > 5 and hit.get("n1") == d["prompt_blocks"] else None

        d = await wait_until(all_blocks_hit, 10, f"every block of the {path} prompt to hit", 0.1)
        assert d["prompt_tokens"] < len(json.dumps(body)) / 3  # the model's tokens
        _, a = await post(approx, decide, body)
        assert a["prompt_blocks"] > 0
        assert all(c["hit_blocks"] == 0 for c in a["candidates"]), "approximate hashes matched?"


async def test_a_router_finds_the_tokenizer_of_the_model_its_engines_serve(
    supervisor: Supervisor, kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    """No tokenizer configured anywhere on the router: the engine serves its model from
    /models/kvgate-test-model (vLLM's /v1/models root), the agent says so in its heartbeats and
    the router finds the same folder under its tokenizer_dirs; from then on its hashes are the
    engine's, block for block."""
    await ensure_topics(kafka_settings)
    folder = tmp_path / "kvgate-test-model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(read_source(SPEC.tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    supervisor.env["KVGATE_ENGINE__TOKENIZER"] = json.dumps(SPEC.model_dump(exclude_none=True))
    supervisor.env["KVGATE_ENGINE__PROFILE__MODEL"] = "/models/kvgate-test-model"
    c = Cluster(supervisor)
    c.add_engine("n1")
    c.add_worker()
    router = c.add_router("found", {"KVGATE_ROUTER__TOKENIZER_DIRS": json.dumps([str(tmp_path)])})
    await c.wait_ready("found", 1)

    async def found() -> bool:
        state = await get(router, "/v1/kvgate/state")
        return bool(state["tokenizers"].get(MODEL) == "found: /models/kvgate-test-model")

    await wait_until(found, 20, "the router to find the model's tokenizer", 0.25)
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are the support assistant of kvgate. " * 30},
            {"role": "user", "content": "How do I tune the prefill weight?"},
        ],
        "max_tokens": 4,
    }
    status, _ = await post(router, "/v1/chat/completions", body)
    assert status == 200

    async def all_blocks_hit() -> dict[str, Any] | None:
        _, d = await post(router, "/v1/kvgate/decide", body)
        hit = {c["node_id"]: c["hit_blocks"] for c in d["candidates"]}
        return d if d["prompt_blocks"] > 5 and hit.get("n1") == d["prompt_blocks"] else None

    await wait_until(all_blocks_hit, 10, "every block of the prompt to hit", 0.1)
