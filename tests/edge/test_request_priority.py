"""A request may lower its own priority (Gateway API Inference Extension criticality, or an
InferenceObjective name mapped by the router), never raise it above its credential's."""

from __future__ import annotations

from router.flow.headers import requested_priority
from tests.edgekit import bearer, completion, edge


def test_headers_only_lower_the_priority() -> None:
    objectives = {"batch-jobs": "low", "vip": "high"}
    ask = requested_priority
    assert ask({"x-gateway-criticality": "Sheddable"}, objectives, "high") == "low"
    assert ask({"x-gateway-criticality": "critical"}, objectives, "normal") == "normal"
    assert ask({"x-gateway-inference-objective": "batch-jobs"}, objectives, "normal") == "low"
    assert ask({"x-gateway-inference-objective": "vip"}, objectives, "low") == "low"
    assert ask({"x-gateway-inference-objective": "unknown"}, objectives, "normal") == "normal"
    assert ask({"x-gateway-criticality": "whatever"}, objectives, "normal") == "normal"
    assert ask({}, objectives, "high") == "high"


async def test_the_decision_records_the_priority_the_request_ran_at() -> None:
    async with edge(router={"objective_priorities": {"batch-jobs": "low"}}) as e:
        for extra in (
            {},
            {"x-gateway-criticality": "Sheddable"},
            {"x-gateway-criticality": "Critical"},
            {"x-gateway-inference-objective": "batch-jobs"},
        ):
            status, body, _ = await e.call(
                "POST", "/v1/completions", completion(), {**bearer("sk-alpha"), **extra}
            )
            assert status == 200, body
        assert [d.priority for d in e.decisions()] == ["normal", "low", "normal", "low"]
