"""Runtime control over kvgate.control: weights reach every router (also one started later) and
are recorded with decisions; hot prefixes get pre-warmed on another node by its agent."""

from __future__ import annotations

import pytest

from deploy.procs import Supervisor
from router.control import weights_message
from router.decision.weights import CostWeights
from streams.kafka import KafkaBus
from streams.schemas import ControlMessage, Decision
from streams.settings import KafkaSettings
from streams.topics import CONTROL, DECISIONS
from tests.conftest import wait_until
from tests.integration.cluster import (
    MODEL,
    Cluster,
    get,
    kvgate_cli,
    long_prompt,
    post,
    read_topic,
)

pytestmark = pytest.mark.integration


async def test_weights_change_at_runtime_on_every_router(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    cluster, url = await Cluster.two_nodes(supervisor)
    assert (await get(url, "/v1/kvgate/state"))["weights_version"] == 1
    cli = kvgate_cli(supervisor, "weights", "--version", "2", "--set", "prefill_weight=1.5")
    assert cli.returncode == 0, cli.stderr

    await wait_until(lambda: _on_version(url, 2), 20, "router on weights v2", 0.2)
    # invalid weights (negative) are refused whole; the router stays on v2
    bad = CostWeights(version=3).model_dump() | {"prefill_weight": -1.0}
    bus = KafkaBus(kafka_settings, "t-control")
    await bus.start()
    try:
        msg = weights_message("kvgate", bad)
        await bus.send(CONTROL, msg.subject, msg)
    finally:
        await bus.stop()
    state = await wait_until(lambda: _refused(url), 20, "the invalid weights refused", 0.2)
    assert state["weights_version"] == 2
    # a router started later starts on the latest weights (the topic is compacted)
    late = cluster.add_router("late")
    await cluster.wait_ready("late", 2)
    await wait_until(lambda: _on_version(late, 2), 20, "late router on weights v2", 0.2)
    # decisions record the version they were made with
    status, _ = await post(
        url, "/v1/completions", {"model": MODEL, "prompt": "hello kvgate", "max_tokens": 4}
    )
    assert status == 200
    decisions = await read_topic(
        kafka_settings, DECISIONS, Decision, lambda got: any(d.chosen_node for d in got)
    )
    assert [d.weights_version for d in decisions if d.chosen_node] == [2]

    # a canary: candidate weights v3 decide about half the requests, v2 the rest
    def weights_cli(*args: str) -> None:
        done = kvgate_cli(supervisor, "weights", *args)
        assert done.returncode == 0, done.stderr

    weights_cli("--version", "3", "--set", "prefill_weight=0.5", "--canary", "0.5")

    async def canary_on() -> bool:
        state = await get(url, "/v1/kvgate/state")
        return bool(state["weights_canary"]["candidate_version"] == 3)

    await wait_until(canary_on, 20, "the canary on the router", 0.2)
    for i in range(24):
        body = {"model": MODEL, "prompt": f"canary request {i}", "max_tokens": 2}
        status, _ = await post(url, "/v1/completions", body)
        assert status == 200
    decisions = await read_topic(
        kafka_settings,
        DECISIONS,
        Decision,
        lambda got: sum(1 for d in got if d.chosen_node) >= 25,
    )
    versions = [d.weights_version for d in decisions if d.chosen_node][1:]
    assert set(versions) == {2, 3} and 4 <= versions.count(3) <= 20, versions
    assert (await get(url, "/v1/kvgate/state"))["weights_version"] == 2  # still the current
    # promoted: the current weights become v3 and the canary is over
    weights_cli("--version", "3", "--set", "prefill_weight=0.5")
    await wait_until(lambda: _on_version(url, 3), 20, "router on weights v3", 0.2)
    state = await get(url, "/v1/kvgate/state")
    assert state["weights_canary"]["candidate_version"] is None


async def _on_version(url: str, want: int) -> bool:
    return bool((await get(url, "/v1/kvgate/state"))["weights_version"] == want)


async def _refused(url: str) -> dict[str, object] | None:
    state = await get(url, "/v1/kvgate/state")
    return state if state["weights_refused"] >= 1 else None


async def test_a_hot_prefix_is_prewarmed_on_another_node(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    _, url = await Cluster.two_nodes(supervisor)
    shared = long_prompt("faq-bot", words=400)

    async def holders() -> list[str]:
        _, d = await post(url, "/v1/kvgate/decide", {"model": MODEL, "prompt": f"{shared} q99"})
        return [c["node_id"] for c in d["candidates"] if c["hit_blocks"] > 0]

    status, _ = await post(
        url, "/v1/completions", {"model": MODEL, "prompt": f"{shared} first", "max_tokens": 2}
    )
    assert status == 200
    (first,) = await wait_until(holders, 20, "the prefix indexed on one node", 0.1)
    for i in range(30):
        status, _ = await post(
            url, "/v1/completions", {"model": MODEL, "prompt": f"{shared} q{i}", "max_tokens": 2}
        )
        assert status == 200
    advice = await read_topic(
        kafka_settings,
        CONTROL,
        ControlMessage,
        lambda got: any(m.kind == "prewarm" for m in got),
    )
    prewarm = [m for m in advice if m.kind == "prewarm"]
    assert prewarm, "no pre-warm advice published"
    payload = prewarm[0].payload
    (target,) = payload["nodes"]
    assert payload["holders"] == [first] and target != first and payload["share"] > 0.75

    async def both_hold() -> bool:
        _, d = await post(url, "/v1/kvgate/decide", {"model": MODEL, "prompt": f"{shared} q99"})
        hits = {c["node_id"]: c["hit_blocks"] for c in d["candidates"]}
        return all(h >= payload["blocks"] for h in hits.values()) and len(hits) == 2

    await wait_until(both_hold, 30, f"{target} to hold the hot prefix after pre-warm", 0.25)
    metrics = await _text(url + "/metrics")
    assert "kvgate_router_prewarm_advice_total 1.0" in metrics


async def _text(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return await r.text()
