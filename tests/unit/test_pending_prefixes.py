"""A prefix in flight is a pending hit: once a request is sent, its node holds its prompt for
routing purposes until the first token, so followers queue behind that prefill instead of
computing the prompt again on the cheapest node (router/decision/recent.py)."""

from __future__ import annotations

import random

import pytest

from agents.profile import EngineProfile
from analytics.sim.replay import replay_trace
from analytics.sim.simconfig import SimConfig
from analytics.sim.traces import Trace
from analytics.sim.workloads import _shared_prefix
from router.decision.inflight import InflightLedger
from router.decision.recent import PendingPrefixes, known_matches
from router.settings import RouterSettings


def test_pending_prompts_match_on_their_node_until_they_are_prefilled() -> None:
    p = PendingPrefixes()
    a = p.add("n1", [1, 2, 3, 4])
    b = p.add("n1", [1, 2, 9])  # another prompt with the same first two blocks
    p.add("n2", [1])
    assert p.match([1, 2, 3, 4, 5]) == {"n1": 4, "n2": 1}
    assert p.match([1, 2, 9, 7]) == {"n1": 3, "n2": 1}
    assert p.match([7, 1]) == {}
    p.remove("n1", a)  # the first prompt's first token came back
    assert p.match([1, 2, 3, 4]) == {"n1": 2, "n2": 1}  # its blocks the other shares stay
    p.remove("n1", b)
    assert p.match([1, 2, 9]) == {"n2": 1} and len(p) == 1


def test_the_ledger_holds_a_pending_prefix_from_dispatch_to_first_token_or_end() -> None:
    ledger = InflightLedger(pending=PendingPrefixes())
    ledger.dispatch("r1", "n1", 0.0, 2000, hashes=[11, 12, 13])
    ledger.dispatch("r2", "n2", 0.0, 2000, hashes=[21, 22])
    assert known_matches({"n3": 1}, [11, 12, 13], 0.1, None, ledger.pending) == {
        "n3": 1,
        "n1": 3,
    }
    ledger.first_token("r1", 1.0)
    assert known_matches({}, [11, 12, 13], 1.0, None, ledger.pending) == {}
    ledger.finish("r2")  # failed before its first token: nothing is pending there either
    assert ledger.pending is not None and len(ledger.pending) == 0
    ledger.dispatch("r3", "n1", 2.0, 100, hashes=[31])
    ledger.sweep(2.0 + ledger.horizon_s + 1)  # a finish that never came
    assert len(ledger.pending) == 0


def _loaded(seed: int) -> tuple[SimConfig, Trace]:
    """Support-bot chat on engines with slow prefill (2,000 tokens/s: a miss costs an engine
    ~1 s), 16 system prompts of 2,000 tokens, 24 requests/s from a cold start."""
    rng = random.Random(seed)
    bots = [(f"bot{i}", 2000) for i in range(16)]
    trace = _shared_prefix(
        "loaded", 480, 24.0, rng, bots, [1.0] * 16, (60, 0.6, 10, 200), (50, 0.5, 16, 96)
    )
    profile = EngineProfile(prefill_tokens_per_s=2000.0, num_gpu_blocks_override=1200)
    return SimConfig(profile=profile), trace


@pytest.mark.parametrize("seed", [1, 3])
def test_followers_of_a_cold_prompt_queue_behind_its_prefill(seed: int) -> None:
    """Without pending hits the first seconds decide the run: followers see no match, prefill
    the prompt again elsewhere, caches fill with copies and misses cascade. With them kvgate at
    its defaults hits at least as often as SGLang's cache-aware router, which inserts into its
    tree at routing time."""
    cfg, trace = _loaded(seed)
    runs = {
        name: replay_trace(trace, nodes=4, policy=rs, load=None, cfg=cfg)
        for name, rs in (
            ("off", RouterSettings(policy="kvgate", pending_prefixes=False)),
            ("kvgate", RouterSettings(policy="kvgate")),
            ("sglang", RouterSettings(policy="sglang_cache_aware")),
        )
    }
    on, off, sglang = runs["kvgate"], runs["off"], runs["sglang"]
    assert on["refused"] == 0
    assert on["hit_rate"] >= off["hit_rate"] + 0.05
    assert on["ttft_p50_s"] <= off["ttft_p50_s"] / 4
    assert on["hit_rate"] >= sglang["hit_rate"] - 0.005
    assert on["ttft_p50_s"] <= sglang["ttft_p50_s"]


def test_at_a_cold_start_on_slow_engines_the_measured_rate_prices_misses_right() -> None:
    """`kvgate bench routing`'s cold start (analytics/sim/coldstart.py): engines 12.5× slower
    than the configured rate, empty caches, a router that learned nothing. With the rate the
    agents measured the followers of a prompt in its first prefill wait for it; without, the
    router believes a miss costs a twelfth of what it does until its first tokens come back."""
    from analytics.sim.coldstart import _capacity, _one

    cap = _capacity(("shared_prompt", 6000, 16))
    told = _one(("shared_prompt", 6000, 16, "kvgate", True, 0.5, cap))
    blind = _one(("shared_prompt", 6000, 16, "kvgate", False, 0.5, cap))
    assert told["policy"] == "kvgate" and blind["policy"] == "kvgate, no probe"
    assert told["refused"] == blind["refused"] == 0
    assert told["ttft_p99_s"] < 0.8 * blind["ttft_p99_s"], (told, blind)
