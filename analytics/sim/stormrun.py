"""Retry-storm experiment: one client ignores Retry-After and retries immediately; do the
other clients get refused more? Run on the simulated cluster with the live admission core and
the live retry-storm guard (its in-process store on the virtual clock).

Requests are spread over ten clients (by position). Well-behaved clients retry after the
Retry-After they were given, up to four attempts; the storm client retries 50 ms after every
refusal, up to 40 attempts (its normal rate times ten and more). The admission queue is off so
that every refusal goes back to the client.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from admission.settings import AdmissionSettings
from analytics.sim.admission import Refused
from analytics.sim.cluster import simulate
from analytics.sim.metrics import pct
from analytics.sim.simconfig import RetryModel, SimConfig, with_router
from analytics.sim.traces import Trace
from router.decision.policies import make_policy
from router.settings import RouterSettings

__all__ = ["STORM_CLIENT", "storm_run", "with_clients"]

STORM_CLIENT = "c0"


def with_clients(trace: Trace, clients: int = 10) -> Trace:
    return Trace(
        trace.name,
        trace.block_size,
        tuple(replace(r, client=f"c{i % clients}") for i, r in enumerate(trace.requests)),
    )


def storm_run(
    trace: Trace,
    *,
    capacity_rps: float,
    load: float,
    nodes: int,
    storm: bool,
    guard: bool,
    slots_per_node: int = 64,
) -> dict[str, Any]:
    rate = len(trace.requests) / max(1e-9, trace.span_s)
    scaled = trace.scaled(rate / (load * capacity_rps))
    admission = AdmissionSettings(
        queue_enabled=False, slots_per_node=slots_per_node, retry_guard=guard
    )
    settings = RouterSettings()
    cfg = with_router(
        SimConfig(
            nodes=nodes,
            admission=admission,
            retries=RetryModel(storm_clients=frozenset({STORM_CLIENT}) if storm else frozenset()),
            storm_guard=guard,
        ),
        settings,
    )
    refused: list[Refused] = []
    done = simulate(scaled, make_policy(settings), cfg, refused_out=refused)
    out: dict[str, Any] = {"storm": storm, "guard": guard, "load": load}
    for group, stormy in (("well_behaved", False), ("storm_client", True)):
        idx = {i for i, r in enumerate(scaled.requests) if (r.client == STORM_CLIENT) is stormy}
        mine = [d for d in done if (d.request.client == STORM_CLIENT) is stormy]
        refusals = [r for r in refused if r.index in idx]
        gave_up = sum(1 for r in refusals if r.final)
        ttft = [d.first_token_s - d.request.arrival_s for d in mine]
        out[group] = {
            "requests": len(idx),
            "completed": len(mine),
            "gave_up_rate": gave_up / len(idx) if idx else 0.0,
            "refused_attempts": len(refusals),
            "retry_storm_refusals": sum(1 for r in refusals if r.reason == "retry_storm"),
            "attempts": len(mine) + len(refusals),
            "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99),
        }
    return out
