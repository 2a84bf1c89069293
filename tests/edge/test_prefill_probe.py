"""The agent's prefill probe against the simulated engine (which prefills at its profile's rate,
in steps, as vLLM does): the rate it measures is the engine's, before any request taught the
routers anything, and the routers price a miss with it until their own samples count."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from pydantic import SecretStr

from agents.probe import PrefillProbe, probe_words, rate_from_pairs
from agents.profile import EngineProfile
from agents.settings import EngineSettings
from agents.simengine import SimEngine


async def _engine(rate: float, api_key: str | None = None) -> TestServer:
    settings = EngineSettings(
        kv_events_endpoint=None,
        api_key=SecretStr(api_key) if api_key else None,
        profile=EngineProfile(prefill_tokens_per_s=rate, num_gpu_blocks_override=4000),
    )
    server = TestServer(SimEngine(settings).app())
    await server.start_server()
    return server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.mark.parametrize("rate", [2_000.0, 25_000.0])
async def test_the_probe_measures_the_engines_prefill_rate(
    http: aiohttp.ClientSession, rate: float
) -> None:
    server = await _engine(rate)
    try:
        probe = PrefillProbe(str(server.make_url("/")), {})
        assert probe.ready(0.0, idle=True) and not probe.ready(0.0, idle=False)
        measured = await probe.measure(http, "llama-3.1-8b", 64_000, now=1.0)
        # the difference quotient takes out the step's fixed cost; what is left is the rate
        # and the prompt's attention (a few % at 2,048 tokens)
        assert measured is not None and 0.85 * rate <= measured <= 1.05 * rate, measured
        assert probe.rate == measured and not probe.due
        probe.restarted()
        assert probe.ready(2.0, idle=True)  # a restarted engine is measured again
    finally:
        await server.close()


async def test_a_probe_the_engine_refuses_is_retried_later_and_reports_nothing(
    http: aiohttp.ClientSession,
) -> None:
    server = await _engine(2_000.0, api_key="engine-key")
    try:
        probe = PrefillProbe(str(server.make_url("/")), {})  # no key: 401
        assert await probe.measure(http, "llama-3.1-8b", None, now=100.0) is None
        assert probe.rate is None and probe.due and probe.failures == 1
        assert not probe.ready(110.0, idle=True) and probe.ready(116.0, idle=True)
        keyed = PrefillProbe(str(server.make_url("/")), {"Authorization": "Bearer engine-key"})
        assert await keyed.measure(http, "llama-3.1-8b", None, now=100.0) is not None
    finally:
        await server.close()


def test_the_probe_prompts_are_uncached_and_the_rate_is_the_median_difference_quotient() -> None:
    a, b = probe_words(100, "kvgate-probe-a"), probe_words(100, "kvgate-probe-b")
    assert a.split()[0] != b.split()[0] and len(a.split()) == 100
    # (short tokens, short s, long tokens, long s): 2,000, 1,000 (a busy step) and 2,100 tokens/s
    pairs = [(16, 0.02, 2016, 1.02), (16, 0.02, 2016, 2.02), (16, 0.02, 2116, 1.02)]
    assert rate_from_pairs(pairs) == pytest.approx(2000.0)
    assert rate_from_pairs([(16, 0.5, 2016, 0.4)]) is None  # the long one was not slower
    assert rate_from_pairs([(16, 0.5, 2016, 0.5000001)]) is None  # noise, not a rate
    assert rate_from_pairs([]) is None
