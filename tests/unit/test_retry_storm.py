"""Retry storm through the simulated cluster: one client retrying immediately (at more than 10×
its normal rate) does not raise the refusals of the well-behaved clients, because the guard
refuses its early retries without touching the budget; without the guard it does."""

from dataclasses import replace

from analytics.sim.replay import capacity_rps, open_trace
from analytics.sim.simconfig import SimConfig
from analytics.sim.stormrun import storm_run, with_clients


def test_a_retry_storm_does_not_crowd_out_well_behaved_clients() -> None:
    trace = with_clients(open_trace("shared_prompt", limit=3000))
    cap = capacity_rps(trace, replace(SimConfig(), nodes=4))

    def run(storm: bool, guard: bool) -> dict[str, dict[str, float]]:
        return storm_run(trace, capacity_rps=cap, load=1.3, nodes=4, storm=storm, guard=guard)

    calm, guarded, unguarded = run(False, True), run(True, True), run(True, False)
    base = calm["well_behaved"]["gave_up_rate"]
    assert 0.05 < base < 0.9  # overloaded enough that refusals happen
    # the storm client really storms: more than 10x the attempts of its fair share
    assert guarded["storm_client"]["attempts"] > 10 * guarded["storm_client"]["requests"]
    assert guarded["storm_client"]["retry_storm_refusals"] > 0
    # with the guard, the well-behaved clients are refused no more than without a storm
    assert guarded["well_behaved"]["gave_up_rate"] <= base + 0.02
    # without it they are (the experiment measures something)
    assert unguarded["well_behaved"]["gave_up_rate"] > guarded["well_behaved"]["gave_up_rate"]
