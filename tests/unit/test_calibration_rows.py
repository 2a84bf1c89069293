"""The engine model against figures other people measured (analytics.calibration)."""

from __future__ import annotations

import pytest

from agents.catalog import derive_profile, find_gpu, find_model
from agents.profile import attention_pairs, batch_latency_s, idle_ttft_s
from analytics.calibration import PUBLISHED, calibration_rows


@pytest.mark.parametrize("row", calibration_rows(), ids=lambda r: r["what"][:40])
def test_every_published_figure_is_within_15_percent(row: dict[str, object]) -> None:
    error = row["error"]
    assert isinstance(error, float)
    assert abs(error) <= 0.15, row


def test_the_rows_cover_three_models_on_two_gpus() -> None:
    batch_rows = {(p.model, p.gpu) for p in PUBLISHED if p.batch}
    assert len({m for m, _ in batch_rows}) == 3
    assert {g for _, g in batch_rows} == {"h100", "h200"}


def test_batch_latency_is_one_prefill_step_then_decode_steps() -> None:
    p = derive_profile(find_model("llama-3.1-8b"), find_gpu("h100"))
    steps = p.step_time_s(0, 0, 4 * 100, 4 * attention_pairs(0, 100))
    steps += sum(p.step_time_s(4, 4 * (100 + i), 0) for i in range(1, 10))
    assert batch_latency_s(p, 4, 100, 10) == pytest.approx(steps)
    # one request and one output token: its prefill alone, one step within the budget
    one_step = p.step_time_s(0, 0, 3000, attention_pairs(0, 3000))
    assert batch_latency_s(p, 1, 3000, 1) == pytest.approx(one_step)


def test_prompts_beyond_the_step_budget_are_chunked() -> None:
    p = derive_profile(find_model("llama-3.1-8b"), find_gpu("h100"))
    small = p.model_copy(update={"max_num_batched_tokens": 1000})
    # the same work in more steps: each step pays the base cost once more
    assert batch_latency_s(small, 8, 500, 1) > batch_latency_s(p, 8, 500, 1)
    # 5,000 tokens in chunks of 1,000: each chunk attends over the ones before it
    chunks = sum(
        small.step_time_s(0, 0, 1000, attention_pairs(start, 1000))
        for start in range(0, 5000, 1000)
    )
    assert idle_ttft_s(small, 5000) == pytest.approx(chunks)
    with pytest.raises(ValueError):
        batch_latency_s(p, 0, 10, 1)
