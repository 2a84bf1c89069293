"""The agent, the worker and the sink serve Prometheus metrics of their own (the router's are
tested with the router): what the agent read from its engine and published, what the worker
folded and holds, what the sink inserted, and how far behind worker and sink are."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.procs import Supervisor, free_port
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings, WorkerSettings
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, long_prompt, post

pytestmark = pytest.mark.integration


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as r,
    ):
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_agent_worker_and_sink_metrics(
    supervisor: Supervisor, kafka_settings: KafkaSettings, worker_settings: WorkerSettings
) -> None:
    await ensure_topics(kafka_settings)
    agent_port, sink_port = free_port(), free_port()
    supervisor.env["KVGATE_AGENT__METRICS_PORT"] = str(agent_port)
    c = Cluster(supervisor)
    c.add_engine("n1")
    supervisor.env.pop("KVGATE_AGENT__METRICS_PORT")
    c.add_worker()
    supervisor.spawn("sink", "sink", env={"KVGATE_SINK__METRICS_PORT": str(sink_port)})
    url = c.add_router()
    await c.wait_ready("router", 1)
    for i in range(3):
        status, _ = await post(
            url,
            "/v1/completions",
            {"model": MODEL, "prompt": long_prompt(f"m{i}"), "max_tokens": 2},
        )
        assert status == 200
    node = (("node", "n1"),)

    async def agent_counted() -> dict[Any, float] | None:
        m = await scrape(agent_port)
        ok = (
            m.get(("kvgate_agent_heartbeats_total", node), 0) > 0
            and m.get(("kvgate_agent_kv_batches_total", node), 0) > 0
            and m.get(("kvgate_agent_kv_blocks_translated_total", node), 0) > 0
            and m.get(("kvgate_agent_kv_blocks", node), 0) > 0
        )
        return m if ok else None

    m = await wait_until(agent_counted, 30, "the agent's metrics", 0.25)
    assert m[("kvgate_agent_kv_index_degraded", node)] == 0
    # the agent measured its engine (how exactly: tests/edge/test_prefill_probe.py)
    assert m[("kvgate_agent_engine_prefill_tokens_per_s", node)] > 0
    assert m[("kvgate_agent_prefill_probe_failures_total", node)] == 0
    assert m[("kvgate_agent_prewarm_refused_total", node)] == 0  # (no control keys here)

    async def sink_counted() -> dict[Any, float] | None:
        s = await scrape(sink_port)
        rows = s.get(("kvgate_sink_rows_inserted_total", (("table", "decisions"),)), 0)
        return s if rows >= 3 and s.get(("kvgate_sink_consumer_lag", ()), -1) == 0 else None

    async def worker_counted() -> dict[Any, float] | None:
        w = await scrape(worker_settings.web_port)
        kv = w.get(("kvgate_worker_folded_total", (("source", "kv_events"),)), 0)
        beats = w.get(("kvgate_worker_folded_total", (("source", "heartbeats"),)), 0)
        return w if kv > 0 and beats > 0 and w.get(("kvgate_worker_index_entries", ()), 0) else None

    w = await wait_until(worker_counted, 30, "the worker's metrics", 0.5)
    assert w[("kvgate_worker_nodes", ())] == 1
    assert w[("kvgate_worker_dead_lettered_total", ())] == 0
    assert w[("kvgate_worker_consumer_lag", (("source", "kv_events"),))] >= 0

    s = await wait_until(sink_counted, 60, "the sink's metrics", 0.5)
    assert s[("kvgate_sink_insert_errors_total", ())] == 0
    assert s[("kvgate_sink_batches_total", ())] >= 1
