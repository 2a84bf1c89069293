"""Admission control in a live router: 401 / 413 / 429 with Retry-After, nothing leaks."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from deploy.procs import Supervisor
from streams.kafka import ensure_topics
from streams.schemas import Decision, LedgerEvent
from streams.settings import KafkaSettings
from streams.topics import DECISIONS, LEDGER
from tests.conftest import REDIS, wait_until
from tests.integration.cluster import MODEL, Cluster, get, metric, post, read_topic

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend", ["inproc", "redis"])
async def test_admission_rejects_typed_and_releases_everything(
    supervisor: Supervisor, kafka_settings: KafkaSettings, backend: str
) -> None:
    await ensure_topics(kafka_settings)
    supervisor.env.update(
        {
            "KVGATE_ADMISSION__BACKEND": backend,
            "KVGATE_REDIS__URL": REDIS,
            "KVGATE_ADMISSION__REQUIRE_API_KEY": "true",
            "KVGATE_ADMISSION__TENANTS": json.dumps(
                {
                    "k-high": {"name": "interactive", "priority": "high"},
                    "k-low": {"name": "batch", "priority": "low"},
                }
            ),
        }
    )
    # 1,024 tokens of KV in the whole cluster
    _c, router = await Cluster.started(supervisor, {"n1": {"num_gpu_blocks": 64}})
    url = router + "/v1/completions"

    async def call(
        http: aiohttp.ClientSession, key: str | None, prompt: str, max_tokens: int
    ) -> tuple[int, dict[str, str], str]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with http.post(
            url,
            json={"model": MODEL, "prompt": prompt, "stream": True, "max_tokens": max_tokens},
            headers=headers,
        ) as r:
            return r.status, dict(r.headers), await r.text()

    async with aiohttp.ClientSession() as http:
        for key in (None, "wrong"):
            status, _, body = await call(http, key, "hi", 4)
            assert status == 401 and "unauthorized" in body
        status, headers, body = await call(http, "k-high", "x" * 4 * 1200, 4)  # 75 blocks > 64
        assert status == 413 and "Retry-After" not in headers and "KV blocks" in body
        # one long-running request holds 36 of 64 blocks; a second one no longer fits
        prompt = "tell me a long story " * 40  # ~210 tokens
        first = asyncio.create_task(call(http, "k-high", prompt, 300))
        await asyncio.sleep(0.3)
        state = await get(router, "/v1/kvgate/state")
        assert state["reservations"] == 1 and state["reserved_kv_blocks"] > 0
        # low priority does not queue: refused at once, with a Retry-After
        status, headers, body = await call(http, "k-low", prompt, 300)
        assert status == 429, body
        assert int(headers["Retry-After"]) >= 1
        err = json.loads(body)["error"]
        assert err["retriable"] is True and err["type"] == "red_watermark"
        # high priority waits in the queue until the first request releases its blocks
        second = asyncio.create_task(call(http, "k-high", prompt, 300))
        await wait_until(lambda: _queued(router), 5, "the high-priority request queued")
        status, _, _ = await first
        assert status == 200
        status, _, body = await second
        assert status == 200, body
    decisions = await read_topic(
        kafka_settings,
        DECISIONS,
        Decision,
        lambda got: sum(d.chosen_node is not None for d in got) >= 2,
    )
    routed = sorted((d for d in decisions if d.chosen_node is not None), key=lambda d: d.ts)
    waits = [d.queue_wait_s for d in routed]  # topic order is per partition: sort by start
    assert waits[0] is None and waits[1] is not None and waits[1] > 0.1

    async def released() -> bool:
        s = await get(router, "/v1/kvgate/state")
        return s["reservations"] == 0 and s["reserved_kv_blocks"] == 0 and s["inflight"] == 0

    await wait_until(released, 5, "every reservation released")


async def _queued(router: str) -> bool:
    return bool((await get(router, "/v1/kvgate/state"))["queued"]["high"] == 1)


async def test_a_client_retrying_without_backing_off_is_refused_harder(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    await ensure_topics(kafka_settings)
    supervisor.env.update(
        {
            "KVGATE_ADMISSION__BACKEND": "redis",
            "KVGATE_REDIS__URL": REDIS,
            "KVGATE_ADMISSION__QUEUE_ENABLED": "false",  # the guard alone, no waiting
        }
    )
    _c, router = await Cluster.started(supervisor, {"n1": {"num_gpu_blocks": 64}})
    body = {
        "model": MODEL,
        "prompt": "tell me a long story " * 40,
        "max_tokens": 300,
        "stream": True,
    }
    async with aiohttp.ClientSession() as http:
        holder = asyncio.create_task(http.post(router + "/v1/completions", json=body))
        await asyncio.sleep(0.3)
        storm_body = {**body, "prompt": "another long story " * 45}
        waits = []
        reasons = []
        for _ in range(4):  # immediately, ignoring Retry-After
            async with http.post(router + "/v1/completions", json=storm_body) as r:
                assert r.status == 429
                waits.append(int(r.headers["Retry-After"]))
                reasons.append((await r.json())["error"]["type"])
        resp = await holder
        async with resp:
            async for _ in resp.content:
                pass
    assert reasons[0] == "red_watermark"
    assert reasons[1:] == ["retry_storm"] * 3
    assert waits[1] <= waits[2] <= waits[3] and waits[3] > waits[0]


@pytest.mark.parametrize("backend", ["inproc", "redis"])
async def test_requests_longer_than_the_lease_keep_their_reservation(
    supervisor: Supervisor, kafka_settings: KafkaSettings, backend: str
) -> None:
    """A 1 s lease, streams of several seconds: the router renews the leases of the streams it
    proxies, a gateway renews its own; nothing expires, everything is released once."""
    await ensure_topics(kafka_settings)
    supervisor.env.update(
        {
            "KVGATE_ADMISSION__BACKEND": backend,
            "KVGATE_REDIS__URL": REDIS,
            "KVGATE_ADMISSION__LEASE_S": "1.0",
            "KVGATE_ADMISSION__SWEEP_INTERVAL_S": "0.1",
        }
    )
    _c, router = await Cluster.started(supervisor, {"n1": {}})
    body = {"model": MODEL, "prompt": "a long answer " * 30, "max_tokens": 400, "stream": True}
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        async with http.post(
            router + "/v1/completions", json=body, headers={"X-Request-Id": "long-1"}
        ) as r:
            assert r.status == 200
            long_rid = r.headers["X-Request-Id"]  # minted by the router
            assert long_rid != "long-1"
            chunks = 0
            async for _ in r.content:
                chunks += 1
                if chunks == 1:
                    continue
                if time.monotonic() - started > 1.5:  # past the first lease
                    state = await get(router, "/v1/kvgate/state")
                    assert state["reservations"] == 1, state
                    break
            async for _ in r.content:
                pass
        assert time.monotonic() - started > 2.0  # the stream really outlived two leases

        # a gateway's request: renewed by the gateway, released by it
        route = {"model": MODEL, "prompt": "gateway " * 40, "max_tokens": 8}
        status, routed = await post(router, "/v1/kvgate/route", route, {"X-Request-Id": "gw-long"})
        gw_rid = routed["reservation_id"]
        assert status == 200 and gw_rid != "gw-long"
        first_lease = routed["lease_expires_at"]
        for _ in range(5):
            await asyncio.sleep(0.4)
            status, renewed = await post(router, "/v1/kvgate/renew", {"reservation_id": gw_rid})
            assert status == 200, renewed
        assert renewed["lease_expires_at"] > first_lease + 1.5
        status, out = await post(router, "/v1/kvgate/release", {"reservation_id": gw_rid})
        assert status == 200, out  # still routed, not forgotten with the first lease
        status, err = await post(router, "/v1/kvgate/renew", {"reservation_id": gw_rid})
        assert status == 404
        status, err = await post(router, "/v1/kvgate/renew", {"reservation": "x"})
        assert status == 400 and "reservation" in err["error"]["message"]

    events = await read_topic(
        kafka_settings,
        LEDGER,
        LedgerEvent,
        lambda got: sum(e.kind == "release" for e in got) >= 2,
    )
    for rid in (long_rid, gw_rid):
        kinds = [e.kind for e in events if e.reservation_id == rid]
        assert kinds[0] == "reserve" and kinds[-1] == "release", kinds
        assert "expire" not in kinds and kinds.count("release") == 1
        assert kinds.count("renew") >= 2, kinds
        leases = [
            e.lease_expires_at for e in events if e.reservation_id == rid and e.kind != "release"
        ]
        assert leases == sorted(leases)

    async def released() -> bool:
        s = await get(router, "/v1/kvgate/state")
        return s["reservations"] == 0 and s["reserved_kv_blocks"] == 0

    await wait_until(released, 5, "every reservation released")


async def test_more_concurrent_requests_than_redis_connections_wait_for_one(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    """Two Redis connections, 40 requests at once: each waits for a connection (bounded by
    redis.pool_timeout_s) instead of failing with "Too many connections" — every request is
    admitted, served and released."""
    await ensure_topics(kafka_settings)
    supervisor.env.update(
        {
            "KVGATE_ADMISSION__BACKEND": "redis",
            "KVGATE_REDIS__URL": REDIS,
            "KVGATE_REDIS__MAX_CONNECTIONS": "2",
            "KVGATE_REDIS__POOL_TIMEOUT_S": "10",
        }
    )
    _c, router = await Cluster.started(supervisor, {"n1": {}})

    async def one(i: int) -> int:
        body = {"model": MODEL, "prompt": f"pool test {i}", "max_tokens": 4, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(router + "/v1/completions", json=body) as r:
                await r.read()
                return r.status

    assert await asyncio.gather(*(one(i) for i in range(40))) == [200] * 40

    async def released() -> bool:
        s = await get(router, "/v1/kvgate/state")
        return s["reservations"] == 0 and s["reserved_kv_blocks"] == 0 and s["inflight"] == 0

    await wait_until(released, 10, "every reservation released")
    calls = await metric(router, 'kvgate_router_redis_scripts{kind="calls"}')
    trips = await metric(router, 'kvgate_router_redis_scripts{kind="round_trips"}')
    assert calls >= 80 and 0 < trips <= calls  # 40 reservations and 40 releases at least
