"""A chaos scenario of the admission store (tests/benchmarks/chaos.py runs it beside the
well-behaved load): the Redis primary dies and its Sentinel fails over.

``redis_failover``: the cluster's router gives way to two routers sharing a Sentinel-managed
Redis (a primary, its replica, one Sentinel); the well-behaved load alternates between them.
Under that load and a burst of long requests through both routers from a normal-priority
tenant weighted to take most of the pool (more than its limit, the red watermark, holds), the
primary is killed -9. Measured:

* ``admitted_again_s``: per router, from the kill to its first request admitted after it (a
  short request of a high-priority tenant goes to each router every 0.1 s: its priority keeps
  room above the burst's limit, so this times the store, not the burst's capacity);
  ``longest_gap_s``: the longest stretch without an admitted request on either router from
  2 s before the kill to the end; ``ready_states``: what each router's ``/ready`` said of its
  store, in turn;
* ``failover_s``: until the Sentinel named the replica the primary; ``shared_again_s``: until
  both routers admitted through it again (their ``/ready``);
* ``peak_held_blocks``: the most KV blocks both routers' reservations held together at once
  (each router's ``held_blocks`` gauge, sampled every 0.2 s), against ``budget_blocks`` (the
  engines' KV), the burst's limit (``burst_limit_blocks``) and the ``share`` each router took
  while the store was away (1 / the routers using the store: unset in their settings).
  ``over_limit_share`` is how far past its limit the burst went, as a share of the budget;
  ``within_share`` says it stayed within the per-router share;
* the burst's and the probes' answers (router 5xx, refusals by type, with and without
  ``Retry-After``).

Afterwards ``chaos.router`` is the first of the two and the reservation count is read from the
new primary, so the scenario's leak check (``leaked_reservations``) and the scenarios after it
run against them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from deploy.procs import free_port
from tests.benchmarks.chaos_fleet import MODEL, error_type
from tests.sentinelset import SentinelSet

if TYPE_CHECKING:
    from tests.benchmarks.chaos import Chaos, Load

CLIENTS = 30  # burst clients per router: together past the budget
NAMES = ("router-a", "router-b")
PROBE = "sk-probe"  # a high-priority tenant of its own: no quota or fair share holds it back
# the burst's tenant: normal priority (up to the red watermark, 90 % of the budget: the probe's
# high priority keeps room above it), weighted to take nearly all of it past yellow
BURST = "sk-burst"
RED = 0.9


async def _ready(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with http.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=3)) as r:
            body: dict[str, Any] = await r.json(content_type=None)
            return body
    return {}


async def _held(http: aiohttp.ClientSession, url: str) -> float:
    name = 'kvgate_router_admission_store_local{kind="held_blocks"}'
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=3)) as r:
            for line in (await r.text()).splitlines():
                if line.startswith(name):
                    return float(line.split()[-1])
    return 0.0


async def _client(
    http: aiohttp.ClientSession,
    url: str,
    until: float,
    admitted: list[tuple[float, str]],
    counts: Counter[str],
) -> None:
    """Long streamed requests one after another until ``until``; the time each was admitted
    (its 200's headers) noted; a refusal retried after its ``Retry-After``."""
    while time.monotonic() < until:
        counts["sent"] += 1
        body = {
            "model": MODEL,
            "prompt": f"[failover {counts['sent']}] " + "long task " * 600,
            "max_tokens": 400,
            "stream": True,
        }
        retry_s = 0.2
        try:
            async with http.post(
                url + "/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {BURST}"},
                timeout=aiohttp.ClientTimeout(total=120),
            ) as r:
                if r.status == 200:
                    admitted.append((time.monotonic(), url))
                    await r.read()
                    counts["ok"] += 1
                    continue
                raw = await r.read()
                if "X-Kvgate-Node" in r.headers:
                    counts["engine_errors"] += 1
                elif r.status >= 500 and r.status != 503:
                    counts["router_5xx"] += 1
                elif r.headers.get("Retry-After") is None:
                    counts["refused_without_retry_after"] += 1
                else:
                    counts[f"refused_{r.status}_{error_type(raw)}"] += 1
                    retry_s = float(r.headers["Retry-After"])
        except (aiohttp.ClientError, TimeoutError):
            counts["connection_errors"] += 1
        await asyncio.sleep(max(0.0, min(retry_s, until - time.monotonic())))


async def _probe(
    http: aiohttp.ClientSession,
    url: str,
    until: float,
    admitted: list[tuple[float, str]],
    counts: Counter[str],
) -> None:
    """A short request every 0.1 s (each a prompt of its own: never an early retry): when
    admission answers again, to the tenth of a second; why not, when it does not."""
    i = 0
    while time.monotonic() < until:
        i += 1
        body = {"model": MODEL, "prompt": f"are you there {i}", "max_tokens": 1}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.post(
                url + "/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {PROBE}"},
                timeout=aiohttp.ClientTimeout(total=10),
            ) as r:
                raw = await r.read()
                if r.status == 200:
                    admitted.append((time.monotonic(), url))
                else:
                    counts[f"probe_{r.status}_{error_type(raw)}"] += 1
        await asyncio.sleep(0.1)


async def redis_failover(chaos: Chaos, load: Load) -> dict[str, Any]:
    redis = SentinelSet(chaos.sup, chaos.tmp / "sentinel")
    await asyncio.to_thread(redis.start)
    load.paused = True  # while the routers change
    await load.drain()
    chaos.sup.kill("router", signal.SIGTERM)  # one store per ledger: it gives way
    urls = []
    for name in NAMES:
        port = free_port()
        env = {**redis.env(), "KVGATE_ROUTER__ROUTER_ID": name}
        chaos.sup.spawn(name, "router", "--port", str(port), env=env)
        urls.append(f"http://127.0.0.1:{port}")
    from tests.benchmarks.chaos import wait_ready

    for url in urls:
        await wait_ready(url)
    load.router, load.alt = urls
    load.paused = False
    chaos.router = urls[0]
    chaos.redis_port = redis.replica_port  # the leak check reads the primary-to-be
    await asyncio.sleep(3.0)  # both routers write the ledger: each takes 1/2 when alone
    counts: Counter[str] = Counter()
    admitted: list[tuple[float, str]] = []
    held: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        until = time.monotonic() + 3.0 + chaos.args.scenario_s
        clients = [
            asyncio.create_task(_client(http, url, until, admitted, counts))
            for url in urls
            for _ in range(CLIENTS)
        ]
        clients += [asyncio.create_task(_probe(http, url, until, admitted, counts)) for url in urls]
        await asyncio.sleep(3.0)
        budget = await _budget(http, urls[0])
        kill_at = time.monotonic()
        redis.kill_primary()
        failover = asyncio.create_task(asyncio.to_thread(redis.wait_failover))
        shared_at = None
        seen: dict[str, list[str]] = {url: [] for url in urls}  # /ready's admission_store
        shares: dict[str, float] = {}
        while time.monotonic() < until:
            held.append(sum([await _held(http, url) for url in urls]))
            states = []
            for url in urls:
                body = await _ready(http, url)
                states.append(body.get("admission_store"))
                if not seen[url] or seen[url][-1] != states[-1]:
                    seen[url].append(str(states[-1]))
                if body.get("admission_store_share") is not None:
                    shares[url] = body["admission_store_share"]
            if shared_at is None and failover.done() and states == ["shared", "shared"]:
                shared_at = time.monotonic()
            await asyncio.sleep(0.2)
        await asyncio.gather(*clients)
        failover_s = await failover
    after = sorted(t for t, _ in admitted if t >= kill_at - 2.0)
    gaps = [b - a for a, b in itertools.pairwise(after)]
    share = max(shares.values(), default=None)
    peak = max(held, default=0.0)
    return {
        "admitted_again_s": {
            name: round(min(t for t, u in admitted if u == url and t >= kill_at) - kill_at, 2)
            if any(u == url and t >= kill_at for t, u in admitted)
            else None
            for name, url in zip(NAMES, urls, strict=True)
        },
        "longest_gap_s": round(max(gaps, default=0.0), 2),
        "ready_states": {name: seen[url] for name, url in zip(NAMES, urls, strict=True)},
        "failover_s": round(failover_s, 2),
        "shared_again_s": None if shared_at is None else round(shared_at - kill_at, 2),
        "share": share,
        "budget_blocks": budget,
        "peak_held_blocks": peak,
        "burst_limit_blocks": int(RED * budget),
        # past the burst's limit (its priority's watermark), as a share of the budget
        "over_limit_share": round(max(0.0, peak - RED * budget) / budget, 4) if budget else None,
        "within_share": bool(budget and share is not None and peak <= budget * (RED + share)),
        "burst": dict(sorted(counts.items())),
    }


async def _budget(http: aiohttp.ClientSession, url: str) -> int:
    """The KV blocks of the healthy nodes a router sees (its budget)."""
    from tests.benchmarks.chaos import ADMIN

    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with http.get(url + "/v1/kvgate/state", headers=headers) as r:
        state = await r.json(content_type=None)
    return sum(int(b["kv_blocks_total"]) for b in state.get("budgets", {}).values())


STORE_SCENARIOS: dict[str, Callable[[Chaos, Load], Awaitable[dict[str, Any]]]] = {
    "redis_failover": redis_failover,
}
