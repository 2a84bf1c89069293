"""Prefill/decode disaggregation in the virtual-time simulator, with the live router's choice
(router/decision/disagg.py): split requests are prefilled on a prefill node, their KV reaches the
decode node after the transfer, decoding there runs without prefills beside it."""

from __future__ import annotations

from collections import Counter

from agents.profile import EngineProfile
from analytics.sim.cluster import simulate
from analytics.sim.simconfig import Done, SimConfig
from analytics.sim.traces import Trace, TraceRequest
from router.decision.policies import make_policy
from router.settings import RouterSettings

PROFILE = EngineProfile(num_gpu_blocks_override=4000, block_size=16)


def trace() -> Trace:
    reqs = tuple(
        TraceRequest(i * 0.05, 1600, 64, tuple(range(i * 1000, i * 1000 + 100))) for i in range(200)
    )
    return Trace("pd", 16, reqs)


def run(roles: tuple[tuple[str, str], ...], link_gbps: float = 100.0) -> list[Done]:
    cfg = SimConfig(nodes=4, profile=PROFILE, roles=roles, kv_link_gbps=link_gbps)
    return simulate(trace(), make_policy(RouterSettings(policy="kvgate")), cfg)


def test_split_requests_decode_on_the_decode_nodes_after_the_transfer() -> None:
    roles = (
        ("node-00", "prefill"),
        ("node-01", "prefill"),
        ("node-02", "decode"),
        ("node-03", "decode"),
    )
    done = run(roles)
    assert len(done) == 200
    assert Counter(d.reason for d in done) == {"disaggregated": 200}
    assert {d.node for d in done} <= {"node-02", "node-03"}
    colocated = run(())
    tpot = lambda ds: max((d.finish_s - d.first_token_s) / 63 for d in ds)  # noqa: E731
    assert tpot(done) < tpot(colocated)  # no prefill beside the decodes
    # the transfer is on the path to the first token: a slow link delays it
    ttft = lambda ds: sorted(d.first_token_s - d.request.arrival_s for d in ds)[100]  # noqa: E731
    slow = run(roles, link_gbps=1.0)
    assert ttft(slow) > ttft(done) + 1600 * 131_072 * 8 / 1e9 * 0.9


def test_without_pools_nothing_is_split_and_mixed_nodes_serve_whole_requests() -> None:
    done = run((("node-00", "prefill"),))  # prefill nodes but no decode node: no split
    assert "disaggregated" not in Counter(d.reason for d in done)
    assert len(done) == 200
