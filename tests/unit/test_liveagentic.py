"""The live agentic workload's sessions: AIPerf's trace turned into chat turns at a scale."""

from __future__ import annotations

import json
from pathlib import Path

from streams.tokenization import approx_tokenize
from tests.benchmarks.liveagentic import AgenticLive, agentic_figures, live_sessions


def _trace(tmp_path: Path) -> Path:
    rows = [
        # two sessions sharing their first two blocks (a system prompt), then their own
        {"session_id": "a", "input_length": 2048, "output_length": 400, "hash_ids": [0, 1, 2, 3]},
        {"session_id": "a", "input_length": 600, "output_length": 80, "hash_ids": [9]},
        {"session_id": "b", "input_length": 2048, "output_length": 40, "hash_ids": [0, 1, 7, 8]},
    ]
    rows[1]["delay"] = 5000  # ms after the previous answer
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sessions_share_the_blocks_the_trace_shares_and_scale_tokens_outputs_and_delays(
    tmp_path: Path,
) -> None:
    w = AgenticLive(token_scale=8.0, output_scale=4.0, delay_scale=10.0, max_turn_tokens=50)
    a, b = live_sessions(w, _trace(tmp_path))
    assert (a.session_id, len(a.turns), b.session_id, len(b.turns)) == ("a", 2, "b", 1)
    first_a, first_b = a.turns[0].text.split(), b.turns[0].text.split()
    half = len(first_a) // 2  # blocks 0 and 1: the same words in both sessions
    assert first_a[:half] == first_b[:half]
    assert first_a[half:] != first_b[half:]
    # 2048 trace tokens ÷ 8 in the simulated engine's tokens, within a block's rounding
    assert abs(len(approx_tokenize(a.turns[0].text)) - 256) <= 16
    assert [t.max_tokens for t in a.turns] == [50, 20]  # 400 ÷ 4 capped at 50; 80 ÷ 4
    assert [t.delay_s for t in a.turns] == [0.0, 0.5]  # 5,000 ms ÷ 10


def test_figures_count_only_answered_turns_and_decode_speed_per_turn() -> None:
    results = [
        {"ok": True, "ttft_s": 0.5, "e2e_s": 2.5, "decode_s": 2.0, "output_tokens": 40},
        {"ok": True, "ttft_s": 1.5, "e2e_s": 2.5, "decode_s": 1.0, "output_tokens": 30},
        {"ok": False, "status": 503},
    ]
    got = agentic_figures(results, span_s=10.0, engines=2)
    assert got["turns"] == 2
    assert got["tok_s_per_gpu"] == 70 / 10.0 / 2
    assert got["tok_s_per_user"] == 25.0  # the median of 20 and 30 tokens/s
    assert got["ttft_p50_s"] == 1.5
