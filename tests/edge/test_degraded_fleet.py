"""Three of five engines down: the router keeps serving on the two left, admitting against what
they can carry (admission sheds the rest by priority), instead of refusing every request while
less than ``admission.min_healthy_share`` of the fleet is healthy."""

from __future__ import annotations

import asyncio

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
