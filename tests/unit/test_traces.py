"""The public traces the README, replay and the routing benchmark use ship with kvgate, byte for
byte as their sources published them (traces/README.md lists the checksums)."""

from __future__ import annotations

import hashlib
import itertools
import re
from pathlib import Path

TRACES = Path(__file__).resolve().parents[2] / "traces"


def test_every_trace_matches_its_published_checksum() -> None:
    listed = re.findall(r"^([0-9a-f]{64})  (\S+)$", (TRACES / "README.md").read_text(), re.M)
    assert len(listed) == 4
    for digest, name in listed:
        assert hashlib.sha256((TRACES / name).read_bytes()).hexdigest() == digest, name
    shipped = {p.name for p in TRACES.iterdir() if p.name != "README.md"}
    assert shipped == {name for _, name in listed}


def test_agentic_sessions_replay_as_growing_conversations() -> None:
    """AIPerf's agentic rows become whole conversations: each turn's prompt is the session so
    far, its blocks extend the previous turn's prompt and answer block for block, the shared
    first blocks (tools, system prompt) are the same in every session, and a turn arrives after
    the previous one's answer (plus its delay)."""
    from analytics.sim.traces import hit_bound, load_trace

    trace = load_trace(TRACES / "aiperf_agentic_code_100s_seed42.jsonl")
    assert len(trace.requests) == 2018 and trace.block_size == 512
    sessions: dict[str, list] = {}
    for r in trace.requests:
        assert r.session_id is not None
        sessions.setdefault(r.session_id, []).append(r)
    assert len(sessions) == 100
    firsts = [turns[0].block_hashes for turns in sessions.values()]
    shared = min(len(b) for b in firsts)
    assert shared >= 60 and all(b[:60] == firsts[0][:60] for b in firsts)  # 30k shared tokens
    for turns in sessions.values():
        for a, b in itertools.pairwise(turns):
            assert b.arrival_s > a.arrival_s + a.output_tokens / 60.0
            assert b.prompt_tokens > a.prompt_tokens + a.output_tokens
            done = a.block_hashes + a.output_block_hashes
            assert b.block_hashes[: len(done)] == done
    assert max(r.prompt_tokens for r in trace.requests) <= 200_000
    assert 0.95 < hit_bound(trace.requests, 512) < 0.97
