"""Head-of-line isolation on a real router (router/decision/lanes.py): a burst of long requests
reaches an engine that prefills slowly, then a few short ones arrive. Without the lane rules the
short
requests wait in the engine's queue behind every long prompt; with them the long requests wait
in the router's queue once the engine is queued, and the short ones overtake them there. Same
engine, same requests, one router with the rules and one without."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.integration.cluster import MODEL, Cluster, get, long_prompt

pytestmark = pytest.mark.integration

PREFILL = "800"  # tokens per second: a long prompt here takes ~0.5 s
COMMON = {"KVGATE_ROUTER__COST__PREFILL_TOKENS_PER_S": PREFILL}
LANES = {
    **COMMON,
    "KVGATE_ROUTER__LANES__LONG_OUTPUT_TOKENS": "100",
    "KVGATE_ROUTER__LANES__HOLD_QUEUE_S": "0.3",
}


async def first_token_at(
    http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> float:
    """When (monotonic clock) the first streamed token arrived."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    first = None
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic()
    assert first is not None
    return first


async def burst(url: str, tag: str) -> tuple[list[float], list[float]]:
    """Six long requests, then (100 ms later) three short ones: when each got its first
    token."""
    async with aiohttp.ClientSession() as http:
        longs = [
            asyncio.create_task(first_token_at(http, url, long_prompt(f"{tag} long {i}", 220), 120))
            for i in range(6)
        ]
        await asyncio.sleep(0.1)
        shorts = [
            asyncio.create_task(first_token_at(http, url, long_prompt(f"{tag} short {i}", 20), 4))
            for i in range(3)
        ]
        return list(await asyncio.gather(*longs)), list(await asyncio.gather(*shorts))


async def test_short_requests_overtake_long_ones_in_the_routers_queue(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    c.add_engine("n1", engine_env={"KVGATE_ENGINE__PROFILE__PREFILL_TOKENS_PER_S": PREFILL})
    c.add_worker()
    plain = c.add_router("plain", env={**COMMON, "KVGATE_ROUTER__LANES__ENABLED": "false"})
    laned = c.add_router("laned", env=LANES)
    await c.wait_ready("plain", 1)
    await c.wait_ready("laned", 1)

    long_off, short_off = await burst(plain, "off")
    await asyncio.sleep(1.0)  # the engine is idle again
    long_on, short_on = await burst(laned, "on")

    # without the rules the short requests wait in the engine's queue behind every long prompt
    assert min(short_off) > max(long_off), (short_off, long_off)
    # with them they overtake the long requests held in the router: only the long request
    # already on the engine (its prefill under way) gets its first token before them
    assert max(short_on) < sorted(long_on)[1], (short_on, long_on)
    assert len(long_on) == 6  # held, not lost: every long request was served
    async with aiohttp.ClientSession() as http, http.get(laned + "/metrics") as r:
        text = await r.text()
    assert 'kvgate_router_lane_holds_total{lane="long"}' in text
    held = float(text.split('kvgate_router_lane_holds_total{lane="long"} ')[1].split()[0])
    assert held >= 3, text
    assert "kvgate_router_lane_queue_requests 0.0" in text  # nobody left behind
    state = await get(laned, "/v1/kvgate/state")
    assert state["lanes"]["enabled"] is True and state["lanes"]["queue"] == 0
