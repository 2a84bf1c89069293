"""Outlier ejection on what the router sees: engines whose metrics and health look fine while
one answers every request with 500 and another accepts requests and never answers. The router
ejects both after a few failures (the client of the hanging one is re-routed), shows it in
/v1/kvgate/state and /metrics, and takes a healed node back through a half-open probe."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, get, long_prompt

pytestmark = pytest.mark.integration

ROUTER_ENV = {
    "KVGATE_ROUTER__OUTLIER__CONSECUTIVE_ERRORS": "3",
    "KVGATE_ROUTER__OUTLIER__BASE_EJECTION_TIME_S": "12",
    "KVGATE_ROUTER__OUTLIER__MAX_EJECTION_PERCENT": "70",
    "KVGATE_ROUTER__UPSTREAM_IDLE_TIMEOUT_S": "1.5",
}


async def send(http: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": long_prompt(f"outlier {i}", 60), "max_tokens": 2}
    async with http.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get("X-Kvgate-Node", "")


async def test_failing_and_hanging_engines_are_ejected_and_a_healed_one_returns(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    c.add_engine("ok")
    broken = c.add_engine("broken", engine_env={"KVGATE_ENGINE__FAULT": "error"})
    c.add_engine("stuck", engine_env={"KVGATE_ENGINE__FAULT": "hang"})
    c.add_worker()
    url = c.add_router("router", env=ROUTER_ENV)
    await c.wait_ready("router", 3)

    statuses: list[tuple[int, str]] = []
    async with aiohttp.ClientSession() as http:
        for i in range(40):
            statuses.append(await send(http, url, i))
    state: dict[str, Any] = await get(url, "/v1/kvgate/state")
    ejected = state["ejected"]
    # ejected for its consecutive failures. The ejection (12 s) outlasts the 40 requests, the
    # stuck node's three 1.5 s timeouts among them, even on a slow machine; if it did not, the
    # node would be probing or ejected again by a failed probe
    assert ejected["broken"]["status"] == "ejected", ejected
    assert ejected["broken"]["cause"] in ("consecutive_5xx", "probe_5xx"), ejected
    assert ejected["stuck"]["status"] == "ejected", ejected
    assert ejected["stuck"]["cause"] in ("consecutive_timeout", "probe_timeout"), ejected
    # the broken node's clients saw its three failures, plus one per failed probe, and no more;
    # the stuck one's clients were re-routed (a timeout before any byte)
    failed = [s for s in statuses if s[0] != 200]
    probes = ejected["broken"]["ejections"] - 1
    assert len(failed) <= 3 + probes and all(node == "broken" for _, node in failed), failed
    # both healthy as far as their own metrics go: the agents keep them in the replica
    assert state["nodes"]["broken"]["healthy"] and state["nodes"]["stuck"]["healthy"]
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'kvgate_router_ejections_total{cause="consecutive_5xx"} 1.0' in text
    assert 'kvgate_router_ejections_total{cause="consecutive_timeout"} 1.0' in text
    assert 'kvgate_router_fleet_nodes{state="ejected"} 2.0' in text

    # healed: after its ejection time a probe succeeds and it takes traffic again
    async with aiohttp.ClientSession() as http:
        async with http.post(broken + "/kvgate/fault", json={"fault": "none"}) as r:
            assert r.status == 200
        back: set[str] = set()

        async def served_again() -> bool:
            status, node = await send(http, url, 1000 + len(back))
            assert status == 200
            back.add(node)
            return "broken" in back

        await wait_until(served_again, 45, "the healed node to take requests again", 0.2)
    state = await get(url, "/v1/kvgate/state")
    assert state["ejected"].get("broken", {}).get("status") in (None, "suspect"), state["ejected"]
    assert state["ejected"]["stuck"]["status"] in ("ejected", "probing")
