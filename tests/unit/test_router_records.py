import orjson
import pytest
from pydantic import ValidationError

from router.decision.types import Candidate, RouteDecision, RouteRequest
from router.flow.served import Served
from router.parse import parse_request
from router.records import decision_record, outcome_record
from streams.blocks import approx_tokenize
from streams.openai import ChatMessage, render_chat


def test_parse_completion_chat_and_token_prompts() -> None:
    p = parse_request(orjson.dumps({"model": "m", "prompt": "hello world!"}), False, 64)
    assert p.tokens == approx_tokenize("hello world!") and p.max_tokens == 64
    assert p.path == "/v1/completions" and not p.stream
    ids = parse_request(
        orjson.dumps({"model": "m", "prompt": [5, 6, 7], "max_tokens": 3}), False, 64
    )
    assert ids.tokens == [5, 6, 7] and ids.max_tokens == 3
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = parse_request(
        orjson.dumps(
            {
                "model": "m",
                "messages": msgs,
                "stream": True,
                "stream_options": {"include_usage": True},
                "metadata": {"session_id": "s1"},
            }
        ),
        True,
        64,
    )
    expected = render_chat(
        [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    )
    assert chat.tokens == approx_tokenize(expected)
    assert chat.stream and chat.include_usage and chat.session_id == "s1"


@pytest.mark.parametrize(
    "raw",
    [
        b"[]",
        b'"x"',
        b'{"model": "m"}',
        b'{"model": "m", "prompt": []}',
        b'{"model": "m", "prompt": [["a"]]}',  # token ids are integers
        b'{"model": "m", "prompt": [[1], []]}',  # an empty prompt in a batch
    ],
)
def test_parse_rejects(raw: bytes) -> None:
    with pytest.raises((ValueError, ValidationError)):
        parse_request(raw, False, 64)


def test_records_carry_inputs_scores_and_timings() -> None:
    p = parse_request(orjson.dumps({"model": "m", "prompt": "x" * 200}), False, 16)
    rreq = RouteRequest("r1", "m", [1, 2, 3], len(p.tokens), 16)
    d = RouteDecision(
        "n1", "prefix_hit", (Candidate("n1", 0.4, 2, 2 / 3, 0.1, 0, True, {"hit": 0.33}),)
    )
    rec = decision_record(
        rreq,
        p,
        d,
        router_id="rt",
        policy="seed_score",
        weights_version=3,
        started=100.0,
        block_size=16,
        decision_us=50.0,
        index_age_s=0.2,
    )
    assert rec.block_hashes == [1, 2, 3] and rec.weights_version == 3
    assert rec.candidates[0].components == {"hit": 0.33}
    relay = Served(
        status="ok",
        http_status=200,
        ttft_s=0.1,
        output_tokens=5,
        usage={"completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 32}},
    )
    out = outcome_record("r1", "n1", relay, p, router_id="rt", started=100.0, now=100.5)
    assert out.e2e_s == pytest.approx(0.5) and out.tpot_s == pytest.approx(0.1)
    assert out.cached_tokens == 32 and out.prompt_tokens == 50
