"""Every surface routes through the one pipeline (router/decision/pipeline.py), and each keeps
its own contract with it: a dry run changes no routing state, a re-route is checked for fit like
any decision, a gateway gets its answer at once."""

from __future__ import annotations

import asyncio
import time

from admission.settings import DEFAULT_SLO_CLASSES, Tenant
from router.decision.policies.cost import CompletionCostPolicy
from streams.codec import decode
from streams.schemas import Outcome
from streams.topics import OUTCOMES
from tests.edgekit import ADMIN, GATEWAY, MODEL, TENANTS, bearer, completion, edge


async def test_a_dry_run_changes_no_routing_state() -> None:
    """``/v1/kvgate/decide`` with a session: the session's home, the average uncached prompt
    and a weights canary's counts are what they were; the same request sent for real moves
    them."""
    async with edge() as e:
        canary = e.router.policy
        base = canary.base
        assert isinstance(base, CompletionCostPolicy)
        newer = base.w.model_copy(update={"version": base.w.version + 1}).model_dump()
        canary.set_candidate(newer, 0.5)
        body = completion("a long prompt " * 200, user="session-42")
        before = (dict(base.sessions.homes), base.model.avg_uncached, dict(canary.decided))
        for _ in range(3):
            status, out, _ = await e.call("POST", "/v1/kvgate/decide", body, bearer(ADMIN))
            assert status == 200 and out["chosen_node"] in e.engines
        assert (dict(base.sessions.homes), base.model.avg_uncached, dict(canary.decided)) == before
        status, _, _ = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
        assert status == 200
        learned = canary.candidate if canary.decided["candidate"] else base
        assert isinstance(learned, CompletionCostPolicy)
        assert hash("session-42") in learned.sessions.homes
        assert sum(canary.decided.values()) == 1


async def test_a_reroute_goes_only_where_the_prompt_fits() -> None:
    """The chosen node is gone before any byte reached the client; of the two others, the idle
    one has no room for the prompt's KV and the busier one has: the re-route takes the one
    that fits, as any decision would."""
    prompt = list(range(1, 801))  # 800 tokens: 50 blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    async with edge(engines=3, router={"policy": "least_requests"}) as e:
        e.overrides = {
            "n2": {"kv_blocks_used": 1990},  # 8 blocks left (2 of them the watermark's)
            "n3": {"waiting": 2},  # busier than n1 and n2 in the heartbeats
        }
        await e.stop_engine("n1")
        await asyncio.sleep(0.5)
        status, out, _ = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
        assert status == 200, out
        first, second = e.decisions()
        assert first.chosen_node == "n1"
        assert second.chosen_node == "n3" and second.reason.startswith("reroute/")
        (o,) = [decode(Outcome, v) for v in e.published(OUTCOMES.suffix)]
        assert o.node_id == "n3" and o.reroutes == 1


async def test_a_gateway_gets_its_answer_at_once_even_for_a_class_that_is_held() -> None:
    """A request of a class that holds requests while their best node is queued: routed
    through the gateway API it is answered at once (the gateway waits for its answer and
    sends it itself), never held in the router."""
    tenants = {**TENANTS, "sk-batch": Tenant(name="batchy", slo_class="batch")}
    async with edge(admission={"tenants": tenants, "slo_classes": DEFAULT_SLO_CLASSES}) as e:
        e.overrides = {n: {"waiting": 6} for n in e.engines}  # every node has work queued
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        status, out, _ = await e.call(
            "POST",
            "/v1/kvgate/route",
            completion(),
            {**bearer("sk-batch"), "X-Kvgate-Gateway-Key": GATEWAY},
        )
        assert status == 200 and out["node_id"] in e.engines, out
        assert time.monotonic() - t0 < e.router.settings.hold_poll_s * 4
        _, text, _ = await e.call("GET", "/metrics")
        assert "kvgate_router_holds_total 0.0" in text


async def test_a_gateway_that_never_releases_loses_its_reservation_with_its_lease() -> None:
    """A gateway routes a request, renews it once, then goes silent: when the renewed lease runs
    out the router ends the request itself — released, recorded as cancelled, gone from the
    in-flight ledger — and never renews it on the gateway's behalf."""
    async with edge(admission={"lease_s": 2.0, "sweep_interval_s": 0.25}) as e:
        gw = {**bearer("sk-alpha"), "X-Kvgate-Gateway-Key": GATEWAY}
        status, out, _ = await e.call("POST", "/v1/kvgate/route", completion(), gw)
        assert status == 200 and out["reservation_id"], out
        rid = out["reservation_id"]
        await asyncio.sleep(1.0)
        status, renewed, _ = await e.call("POST", "/v1/kvgate/renew", {"reservation_id": rid}, gw)
        assert status == 200 and renewed["lease_expires_at"] > out["lease_expires_at"]
        for _ in range(80):  # the renewed lease runs out about 2 s from now
            if await e.reservations() == 0:
                break
            await asyncio.sleep(0.1)
        assert await e.reservations() == 0 and not e.router.gate.held
        assert len(e.router.ledger) == 0
        (o,) = [decode(Outcome, v) for v in e.published(OUTCOMES.suffix)]
        assert o.request_id == rid and o.status == "cancelled" and "lease" in (o.error or "")
        status, _, _ = await e.call("POST", "/v1/kvgate/release", {"reservation_id": rid}, gw)
        assert status == 404
