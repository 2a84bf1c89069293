"""The whole pipeline on the real broker: engine → agent → Kafka → Faust → router → ClickHouse."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from analytics.clickhouse import open_clickhouse
from analytics.schema import migrate
from analytics.settings import ClickHouseSettings, SinkSettings
from analytics.sink import Sink
from deploy.procs import Supervisor
from streams.blocks import approx_tokenize, chain_hashes
from streams.fit import admissible_blocks
from streams.kafka import KafkaBus, ensure_topics
from streams.schemas import Heartbeat
from streams.settings import KafkaSettings
from streams.topics import HEARTBEATS
from tests.conftest import wait_until
from tests.integration.cluster import MODEL, Cluster, get, long_prompt, post, read_topic

pytestmark = pytest.mark.integration


async def test_engine_cache_reaches_tables_and_router_within_2s(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    c, router = await Cluster.two_nodes(supervisor)
    engine = c.engines["n1"]

    prompt = long_prompt("freshness")
    blocks = len(chain_hashes(approx_tokenize(prompt), 16))
    status, _ = await post(
        engine, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    )
    assert status == 200
    cached_at = time.monotonic()

    async def visible() -> bool:
        _, d = await post(router, "/v1/kvgate/decide", {"model": MODEL, "prompt": prompt})
        hits = {cand["node_id"]: cand["hit_blocks"] for cand in d["candidates"]}
        return hits.get("n1") == blocks and d["chosen_node"] == "n1"

    await wait_until(visible, 2.0, "the engine's cached prefix in the router's replica")
    assert time.monotonic() - cached_at <= 2.0

    state = await get(router, "/v1/kvgate/state")
    assert state["nodes"]["n1"]["indexed_blocks"] >= blocks
    assert state["nodes"]["n2"]["alive"]

    # the agents say how large a request their engine can take now, and its context limit
    def told(got: list[Heartbeat]) -> bool:
        return any(h.max_model_len is not None for h in got)

    beats = await read_topic(kafka_settings, HEARTBEATS, Heartbeat, told, 30)
    hb = next(h for h in beats if h.max_model_len is not None)
    assert hb.kv_blocks_admissible == admissible_blocks(hb.kv_blocks_total, hb.kv_blocks_used, 0.01)
    assert hb.max_model_len > 1000


async def test_each_routed_request_yields_one_decision_and_one_outcome_row(
    supervisor: Supervisor, kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    await ensure_topics(kafka_settings)
    c = Cluster(supervisor)
    c.add_engine("n1")
    c.add_engine("n2")
    c.add_worker()
    router = c.add_router()
    ch = open_clickhouse(ClickHouseSettings(path=str(tmp_path / "ch")))
    migrate(ch, "kvgate")
    bus = KafkaBus(kafka_settings, "test-sink")
    await bus.start()
    stop = asyncio.Event()
    sink = Sink(
        kafka_settings, SinkSettings(group_id="sink-test", batch_interval_s=0.3), ch, "kvgate", bus
    )
    task = asyncio.create_task(sink.run(stop))
    try:
        await c.wait_ready("router", 2)
        ids = []
        for i in range(24):
            rid = f"req-{uuid.uuid4().hex[:8]}"
            ids.append(rid)
            body: dict[str, object] = {"model": MODEL, "max_tokens": 4, "stream": i % 2 == 0}
            if i % 3 == 0:
                body["messages"] = [
                    {"role": "system", "content": long_prompt("sys")},
                    {"role": "user", "content": f"question {i}"},
                ]
                path = "/v1/chat/completions"
            else:
                body["prompt"] = long_prompt("doc") + f" q{i}"
                path = "/v1/completions"
            status, _ = await post(router, path, body, {"X-Request-Id": rid})
            assert status == 200
        status, _ = await post(router, "/v1/completions", {"model": "unknown", "prompt": "x"})
        assert status == 404  # not routed: a refusal record, no outcome

        async def landed() -> bool:
            rows = ch.query("SELECT count() AS n FROM kvgate.outcomes FINAL")
            return int(rows[0]["n"]) >= len(ids)

        await wait_until(landed, 20, "outcomes in ClickHouse", 0.2)
        await asyncio.sleep(1.0)  # anything extra would have landed by now
        # the router mints request ids; the client's X-Request-Id is a label on the decision
        routed = "reason != 'refused_before_admission'"
        labels = ch.query(
            "SELECT request_id, client_request_id AS label FROM kvgate.decisions FINAL "
            f"WHERE {routed}"
        )
        assert sorted(r["label"] for r in labels) == sorted(ids)
        minted = sorted(r["request_id"] for r in labels)
        assert not set(minted) & set(ids) and len(set(minted)) == len(ids)
        for table in ("decisions", "outcomes"):
            where = f"WHERE {routed}" if table == "decisions" else ""
            final = ch.query(
                f"SELECT request_id, count() AS n FROM kvgate.{table} FINAL {where} "
                "GROUP BY request_id"
            )
            raw = ch.query(f"SELECT count() AS n FROM kvgate.{table} {where}")
            assert sorted(r["request_id"] for r in final) == minted, table
            assert all(int(r["n"]) == 1 for r in final)
            assert int(raw[0]["n"]) == len(ids), f"{table}: duplicated rows before merges"
        ok = ch.query(
            "SELECT countIf(status = 'ok') AS ok, countIf(ttft_s > 0) AS ttft, "
            "sum(ifNull(cached_tokens, 0)) AS cached FROM kvgate.outcomes FINAL"
        )[0]
        assert int(ok["ok"]) == len(ids) and int(ok["ttft"]) == len(ids)
        refused = ch.query(
            "SELECT model, admission_reason FROM kvgate.decisions FINAL WHERE NOT " + routed
        )
        assert refused == [{"model": "unknown", "admission_reason": "unknown_model"}]
        assert int(ok["cached"]) > 0  # shared prompts were served from the prefix cache
        chosen = ch.query(
            f"SELECT DISTINCT chosen_node AS n FROM kvgate.decisions FINAL WHERE {routed}"
        )
        assert {r["n"] for r in chosen} <= {"n1", "n2"}
        admitted = ch.query(
            "SELECT countIf(admission = 'admitted' AND kv_blocks_estimate > 0 "
            "AND budget_usage > 0 AND tenant = 'anonymous') AS n FROM kvgate.decisions FINAL"
        )[0]
        assert int(admitted["n"]) == len(ids)  # every decision carries its admission inputs
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await bus.stop()
        ch.close()
