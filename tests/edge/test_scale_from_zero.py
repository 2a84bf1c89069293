"""A model scaling up from zero: its requests wait for the first ready node instead of being
refused, a gateway's are refused at once with a Retry-After learned from past starts, and a
request waits no longer than its bound."""

from __future__ import annotations

import asyncio
import time

from tests.edgekit import GATEWAY, MODEL, Edge, bearer, completion, edge


async def _metric(e: Edge, name: str) -> float:
    _, text, _ = await e.call("GET", "/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def test_requests_wait_for_a_starting_node_and_go_once_it_is_ready() -> None:
    async with edge(engines=1) as e:
        e.overrides = {"n1": {"healthy": False}}  # its pod is up, its engine is not ready yet
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        calls = [
            asyncio.create_task(e.call("POST", "/v1/completions", completion(), bearer("sk-alpha")))
            for _ in range(3)
        ]
        # the gateway API is not held: refused at once, told when to come back
        status, body, headers = await e.call(
            "POST",
            "/v1/kvgate/route",
            completion(),
            {**bearer("sk-alpha"), "X-Kvgate-Gateway-Key": GATEWAY},
        )
        assert status == 503 and body["error"]["kvgate_reason"] == "scaling"
        assert int(headers["Retry-After"]) >= 1
        await asyncio.sleep(1.0)
        assert await _metric(e, "kvgate_router_scale_waiting") == 3
        e.overrides = {}  # ready
        results = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert [r[0] for r in results] == [200, 200, 200]
        assert time.monotonic() - t0 >= 1.0
        assert await _metric(e, 'kvgate_router_scale_wait_seconds_count{result="served"}') == 3
        assert await _metric(e, "kvgate_router_scale_waiting") == 0
        # the start was learned: the next cold period's Retry-After is about as long
        learned = e.router.director.scaleroom.ups.expected_s(MODEL)
        assert 1.0 <= learned < 5.0
        assert await e.reservations() == 0


async def test_a_model_at_zero_waits_then_is_refused_with_the_time_left() -> None:
    """No node of the model at all (its pool scaled to zero): listed in router.models_at_zero,
    its requests wait (not a 404) and, past router.scale_wait_s, get 503 scaling."""
    router = {"models_at_zero": [MODEL], "scale_wait_s": 0.6, "scale_up_s": 30.0}
    async with edge(engines=1, router=router) as e:
        e.overrides = {"n1": {"model": "another-model"}}  # nothing serves MODEL
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        status, body, headers = await e.call(
            "POST", "/v1/completions", completion(), bearer("sk-alpha")
        )
        waited = time.monotonic() - t0
        assert status == 503 and body["error"]["kvgate_reason"] == "scaling", body
        assert 0.5 <= waited < 3.0
        assert 27 <= int(headers["Retry-After"]) <= 30  # the expected start, less the wait
        # a model nobody serves or lists is still unknown
        status, _, _ = await e.call(
            "POST", "/v1/completions", {**completion(), "model": "nope"}, bearer("sk-alpha")
        )
        assert status == 404
        assert await _metric(e, 'kvgate_router_rejections_total{reason="scaling"}') == 1


async def test_a_node_that_served_and_failed_is_a_failure_not_a_start() -> None:
    """The waiting room is for nodes coming up: once a node was ready, its engine failing is
    answered at once as before (no wait)."""
    async with edge(engines=1) as e:
        await asyncio.sleep(0.5)
        status, _, _ = await e.call("POST", "/v1/completions", completion(), bearer("sk-alpha"))
        assert status == 200
        e.overrides = {"n1": {"healthy": False}}
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        status, body, _ = await e.call("POST", "/v1/completions", completion(), bearer("sk-alpha"))
        assert status == 503 and body["error"]["kvgate_reason"] != "scaling", body
        assert time.monotonic() - t0 < 1.0
