"""A request goes only where its KV fits (router/decision/fit.py), and a node that fails it before
the client sees anything gets it re-routed once, the outcome saying so."""

from __future__ import annotations

import pytest

from deploy.procs import Supervisor, free_port
from streams.kafka import ensure_topics
from streams.schemas import Decision, Outcome
from streams.settings import KafkaSettings
from streams.topics import DECISIONS, OUTCOMES
from tests.integration.cluster import MODEL, Cluster, post, read_topic

pytestmark = pytest.mark.integration


async def test_a_request_skips_a_node_it_cannot_fit_and_is_rerouted_once(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    # round-robin ignores KV: only the fit filter keeps the request off n1 (128 tokens of KV);
    # n2's agent advertises an address where nothing listens (its engine is fine)
    supervisor.env.update({"KVGATE_ROUTER__POLICY": "round_robin"})
    dead = f"http://127.0.0.1:{free_port()}"
    _c, url = await Cluster.started(
        supervisor,
        {
            "n1": {"num_gpu_blocks": 8},
            "n2": {"agent_env": {"KVGATE_AGENT__ADVERTISE_URL": dead}},
            "n3": {},
        },
    )
    prompt = "a prompt longer than one hundred and twenty eight tokens " * 12  # ~170 tokens
    status, body = await post(
        url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    )
    assert status == 200, body
    outcomes = await read_topic(kafka_settings, OUTCOMES, Outcome, lambda got: len(got) >= 1)
    (o,) = outcomes
    assert o.node_id == "n3" and o.reroutes == 1 and o.status == "ok"
    # both decisions are recorded, told apart by decision_seq; n1 was never a choice
    decisions = await read_topic(kafka_settings, DECISIONS, Decision, lambda got: len(got) >= 2)
    first, second = sorted(decisions, key=lambda d: d.decision_seq)
    assert first.request_id == second.request_id == o.request_id
    assert (first.decision_seq, first.chosen_node) == (0, "n2")
    assert second.decision_seq == 1 and second.chosen_node == "n3"
    assert second.reason.startswith("reroute/")
