"""Approximate token counts are calibrated against the engine's own counts, so admission does not
reserve KV for tokens that are not there."""

from __future__ import annotations

import asyncio

from router.decision.calibrate import TokenCalibration
from streams.tokenization import TokenizerSpec
from tests.edgekit import ADMIN, GATEWAY, bearer, completion, edge

TEXT = "The quick brown fox jumps over the lazy dog while the router counts tokens. " * 20


def test_the_ratio_waits_for_samples_and_follows_them() -> None:
    c = TokenCalibration(alpha=0.5, min_samples=3)
    for _ in range(2):
        c.observe("m", 100, 60)
    assert c.ratio("m") == 1.0 and c.prompt_tokens("m", 100) == 100
    c.observe("m", 100, 60)
    assert abs(c.ratio("m") - 0.6) < 1e-9 and c.prompt_tokens("m", 100) == 60
    c.observe("m", 0, 5)  # nothing counted: ignored
    c.observe("m", 100, 10_000)  # clamped at 10
    assert c.ratio("m") == 0.6 + 0.5 * (10 - 0.6)


async def test_an_approximate_router_learns_the_engines_token_counts() -> None:
    engine = {"tokenizer": TokenizerSpec(tokenizer="package:anthropic/tokenizer.json")}
    async with edge(engines=1, engine=engine) as e:
        gw = {"X-Kvgate-Gateway-Key": GATEWAY}
        status, before, _ = await e.call("POST", "/v1/kvgate/route", completion(TEXT), gw)
        assert status == 200
        await e.call("POST", "/v1/kvgate/release", {"reservation_id": before["reservation_id"]}, gw)
        for i in range(6):
            status, _, _ = await e.call("POST", "/v1/completions", completion(f"{i} {TEXT}"))
            assert status == 200
        status, state, _ = await e.call("GET", "/v1/kvgate/state", headers=bearer(ADMIN))
        ratio = state["token_calibration"]["llama-3.1-8b"]["ratio"]
        assert 0.2 < ratio < 0.9  # the real tokenizer makes fewer tokens than 4-byte chunks
        status, after, _ = await e.call("POST", "/v1/kvgate/route", completion(TEXT), gw)
        assert status == 200
        assert after["kv_blocks_reserved"] < before["kv_blocks_reserved"]


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WRONG = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


async def test_a_wrong_tokenizer_is_caught_by_the_engines_tokenize() -> None:
    """The engine renders ChatML; a router configured with another template disagrees on every
    checked request, and after tokenize_check_min checks the model is marked approximate."""
    engine_spec = TokenizerSpec(tokenizer="package:anthropic/tokenizer.json", chat_template=CHATML)
    for template, wrong in ((WRONG, True), (CHATML, False)):
        router_spec = TokenizerSpec(
            tokenizer="package:anthropic/tokenizer.json", chat_template=template
        )
        router = {
            "tokenizers": {"llama-3.1-8b": router_spec},
            "tokenize_check_every": 1,
            "tokenize_check_min": 3,
        }
        async with edge(engines=1, engine={"tokenizer": engine_spec}, router=router) as e:
            for i in range(4):
                body = {
                    "model": "llama-3.1-8b",
                    "messages": [{"role": "user", "content": f"question {i}: {TEXT}"}],
                    "max_tokens": 2,
                }
                status, _, _ = await e.call("POST", "/v1/chat/completions", body)
                assert status == 200
                await asyncio.sleep(0.2)  # the check runs beside the request
            status, state, _ = await e.call("GET", "/v1/kvgate/state", headers=bearer(ADMIN))
            report = state["tokenization_checks"]["llama-3.1-8b"]
            assert report["checks"] >= 3
            assert report["approximate"] is wrong
            assert (report["mismatches"] == report["checks"]) is wrong
            assert (report["mismatches"] == 0) is not wrong
            metrics = (await e.call("GET", "/metrics"))[1]
            assert "kvgate_tokenization_mismatches_total" in metrics or not wrong
            # once marked, decisions say the tokens are approximate
            assert e.decisions()[-1].approximate_tokens is wrong
