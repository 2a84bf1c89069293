"""Prefill/decode disaggregation, the pure part (router/decision/disagg.py): roles, the pair and
its cost, and the two requests of vLLM's disaggregated flow (field names as vLLM's NixlConnector and
its
proxies use them)."""

from __future__ import annotations

import pytest

from router.decision.disagg import (
    colocated_cost,
    decode_body,
    plan_pd,
    prefill_body,
    split_roles,
    transfer_s,
    valid_transfer_params,
)
from router.decision.policies.cost import CompletionCostPolicy
from router.decision.types import RouteRequest
from router.decision.weights import CostWeights
from tests.factories import NOW, node_view

REQ = RouteRequest("r1", "m", list(range(100)), prompt_tokens=1600, max_tokens=64)


def policy() -> CompletionCostPolicy:
    return CompletionCostPolicy(CostWeights(), max_kv_used_ratio=0.95, max_queue=64)


def test_roles_split_the_fleet() -> None:
    nodes = [node_view("m1"), node_view("p1", role="prefill"), node_view("d1", role="decode")]
    mixed, pre, dec = split_roles(nodes)
    assert [n.node_id for n in mixed] == ["m1"]
    assert [n.node_id for n in pre] == ["p1"] and [n.node_id for n in dec] == ["d1"]


def test_the_pair_prefers_the_cached_prefill_node_and_the_free_decode_node() -> None:
    pre = [node_view("p1", role="prefill"), node_view("p2", role="prefill")]
    dec = [
        node_view("d1", role="decode", used=90, running=40),
        node_view("d2", role="decode", used=10, running=2),
    ]
    plan = plan_pd(
        policy(),
        REQ,
        pre,
        dec,
        {"p2": 90},
        NOW,
        kv_bytes_per_token=131_072,
        default_link_gbps=100.0,
    )
    assert plan is not None
    assert (plan.prefill.chosen, plan.decode.chosen) == ("p2", "d2")
    assert plan.transfer_s == pytest.approx(transfer_s(1600, 131_072, 100.0))
    assert plan.transfer_s == pytest.approx(1600 * 131_072 * 8 / 100e9)
    assert plan.cost_s is not None and plan.cost_s > plan.transfer_s
    # a slower link on the decode node costs more
    slow = [node_view("d2", role="decode", used=10, running=2, kv_link_gbps=1.0)]
    slow_plan = plan_pd(
        policy(), REQ, pre, slow, {}, NOW,
        kv_bytes_per_token=131_072, default_link_gbps=100.0,
    )  # fmt: skip
    assert slow_plan is not None and slow_plan.transfer_s == pytest.approx(1.6777216)
    assert plan_pd(
        policy(), REQ, pre, [], {}, NOW,
        kv_bytes_per_token=1, default_link_gbps=1.0,
    ) is None  # fmt: skip
    mixed = policy().decide(REQ, [node_view("m1")], {}, NOW)
    assert colocated_cost(mixed) is not None


def test_the_prefill_request_asks_for_a_remote_decode_and_one_token() -> None:
    body = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 64,
        "max_completion_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 8,
    }
    p = prefill_body(body)
    assert p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert p["stream"] is False and p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert "stream_options" not in p and "min_tokens" not in p
    assert body["stream"] is True  # the client's request is left as it was
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2]}
    d = decode_body(body, params)
    assert d["kv_transfer_params"] == params and d["max_tokens"] == 64 and d["stream"] is True


@pytest.mark.parametrize(
    ("answer", "ok"),
    [
        ({"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1]}}, True),
        ({"kv_transfer_params": {"do_remote_prefill": False}}, False),
        ({"kv_transfer_params": None}, False),
        ({}, False),
        ([], False),
        ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "x" * 300}}, False),
        ({"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": "1,2"}}, False),
    ],
)
def test_only_usable_transfer_params_are_passed_on(answer: object, ok: bool) -> None:
    assert (valid_transfer_params(answer) is not None) == ok
