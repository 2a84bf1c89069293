"""Three of five engines down: the router keeps serving on the two left, admitting against what
they can carry (admission sheds the rest by priority), instead of refusing every request while
less than ``admission.min_healthy_share`` of the fleet is healthy; and before their heartbeats
say so, a request that meets one dead engine after another goes on to one that answers."""

from __future__ import annotations

import asyncio

from streams.codec import decode
from streams.schemas import Outcome
from streams.topics import OUTCOMES
from tests.edgekit import completion, edge


async def test_three_of_five_engines_down_the_two_left_serve() -> None:
    async with edge(engines=5) as e:
        for node in ("n3", "n4", "n5"):
            e.overrides[node] = {"healthy": False}
            await e.stop_engine(node)
        await asyncio.sleep(0.6)  # the next heartbeats say so
        before = len(e.decisions())
        for i in range(8):
            status, out, _ = await e.call("POST", "/v1/completions", completion(f"q{i} " * 30))
            assert status == 200, out  # was 503 nodes_unhealthy: 40 % of the capacity healthy
        assert {d.chosen_node for d in e.decisions()[before:]} <= {"n1", "n2"}
        metrics = (await e.call("GET", "/metrics"))[1]
        line = next(
            x for x in metrics.splitlines() if x.startswith("kvgate_router_degraded_fleet_requests")
        )
        assert float(line.split()[-1]) >= 8
        assert await e.reservations() == 0  # nothing held once answered


async def test_engines_gone_before_their_heartbeats_say_so_are_tried_past() -> None:
    """Three of five engines die at once and their last heartbeats still read healthy: a
    request the router sends to one of them goes on to the best node that has not failed it,
    up to three times, before the client sees anything — one re-route would leave a request
    whose first two picks are both dead with a 502."""
    async with edge(engines=5, router={"policy": "least_requests"}) as e:
        # the dead ones look idlest: the policy picks them first, one after another
        e.overrides = {n: {"waiting": 5} for n in ("n1", "n2")}
        for node in ("n3", "n4", "n5"):
            await e.stop_engine(node)
        await asyncio.sleep(0.5)
        status, out, _ = await e.call("POST", "/v1/completions", completion("dead " * 30))
        assert status == 200, out
        chosen = [d.chosen_node for d in e.decisions()]
        assert set(chosen[:3]) == {"n3", "n4", "n5"} and chosen[3] in {"n1", "n2"}, chosen
        assert [d.decision_seq for d in e.decisions()] == [0, 1, 2, 3]
        (o,) = [decode(Outcome, v) for v in e.published(OUTCOMES.suffix)]
        assert o.node_id == chosen[3] and o.reroutes == 3 and o.status == "ok"
        assert await e.reservations() == 0
