"""A node that cannot fit a routed request's KV: the router re-routes it once, before the client
sees anything, and the outcome says so."""

from __future__ import annotations

import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.schemas import Decision, Outcome
from streams.settings import KafkaSettings
from streams.topics import DECISIONS, OUTCOMES
from tests.integration.cluster import MODEL, Cluster, post, read_topic

pytestmark = pytest.mark.integration


async def test_a_request_refused_for_kv_is_rerouted_once(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    # round-robin ignores KV, so the first request goes to n1 (id order), which cannot hold it
    supervisor.env.update({"KVGATE_ROUTER__POLICY": "round_robin"})
    # n1 has 128 tokens of KV
    _c, url = await Cluster.started(
        supervisor, {"n1": {"num_gpu_blocks": 8}, "n2": {"num_gpu_blocks": 2000}}
    )
    prompt = "a prompt longer than one hundred and twenty eight tokens " * 12  # ~170 tokens
    status, body = await post(
        url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    )
    assert status == 200, body
    outcomes = await read_topic(kafka_settings, OUTCOMES, Outcome, lambda got: len(got) >= 1)
    (o,) = outcomes
    assert o.node_id == "n2" and o.reroutes == 1 and o.status == "ok"
    # both decisions are recorded, told apart by decision_seq
    decisions = await read_topic(kafka_settings, DECISIONS, Decision, lambda got: len(got) >= 2)
    first, second = sorted(decisions, key=lambda d: d.decision_seq)
    assert first.request_id == second.request_id == o.request_id
    assert (first.decision_seq, first.chosen_node) == (0, "n1")
    assert second.decision_seq == 1 and second.chosen_node == "n2"
    assert second.reason.startswith("reroute/")
