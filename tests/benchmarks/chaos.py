"""Chaos: a live kvgate cluster under steady load while its parts fail and its clients misbehave.

    python -m tests.benchmarks.chaos [--quick]

Starts its own Kafka (port 19192) and Redis (port 16479) with the repo's launchers, two simulated
engines with their agents, a worker, a router (Redis reservations, 10 s leases, tenant quotas) and
the sink (ClickHouse's HTTP interface in front of chDB, as in the tests), then runs the scenarios
one after another. Well-behaved clients (two tenants) send streamed completions throughout; every
answer's minted request id (``X-Request-Id``) is checked against ClickHouse at the end.

Per scenario (``docs/benchmarks/chaos.json``): ``requests`` and ``ok`` of the well-behaved load
during the scenario; ``errors_5xx`` (5xx answers that are not typed refusals: a refusal with
``Retry-After`` such as 503 ``store_unavailable`` counts in ``refused_503``, an engine's failure
in ``engine_errors``); ``leaked_reservations`` (held in Redis once every request of the scenario
ended and one lease passed); ``lost_decisions`` / ``duplicated_decisions`` (ok requests without
their decision row in ClickHouse, and rows beyond one per decision, read with ``FINAL``);
``router_alive``. Writes ``docs/benchmarks/chaos.json`` and ``chaos.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from redis.asyncio import Redis

from deploy.procs import DEPLOY, LocalInfra, Supervisor, free_port
from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from tests.benchmarks.chaos_clients import CLIENT_SCENARIOS, LOW, STALL, post_status
from tests.benchmarks.chaos_fleet import FLEET_SCENARIOS, HIGH
from tests.benchmarks.chaos_store import BURST, PROBE, STORE_SCENARIOS
from tests.benchmarks.chaos_streams import KEY as STREAMS
from tests.benchmarks.chaos_streams import STREAM_SCENARIOS
from tests.chfront import ChdbFront

OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
KAFKA_PORT, REDIS_PORT = 19192, 16479
MODEL = "llama-3.1-8b"
ADMIN, GATEWAY = "chaos-admin", "chaos-gateway"
GOOD = ["sk-good-a", "sk-good-b"]
FLOOD = "sk-flood"
LEASE_S = 10.0
REDIS_URL = f"redis://127.0.0.1:{REDIS_PORT}/0"
TYPED_503 = {"store_unavailable", "nodes_unhealthy", "no_capacity"}
# misbehaving clients come from addresses of their own (the well-behaved load: 127.0.0.1), as
# they would: the router's per-client connection share tells them apart
SLOW_ADDR, STALL_ADDR = "127.0.0.5", "127.0.0.6"


@dataclass
class Load:
    """The well-behaved clients: results per scenario."""

    router: str
    http: aiohttp.ClientSession
    alt: str | None = None  # a second router: every other request goes there
    scenario: str = "warmup"
    rps: float = 8.0
    results: dict[str, Counter[str]] = field(default_factory=dict)
    ok_ids: dict[str, list[str]] = field(default_factory=dict)
    inflight: set[asyncio.Task[None]] = field(default_factory=set)
    stop: bool = False
    paused: bool = False

    async def one(self, key: str, i: int) -> None:
        scenario = self.scenario
        counts = self.results.setdefault(scenario, Counter())
        body = {
            "model": MODEL,
            "prompt": f"[{key}] shared system prompt " * 20 + f" question {i}",
            "max_tokens": 16,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {key}", "X-Request-Id": f"chaos-{i}"}
        try:
            async with self.http.post(
                (self.alt if self.alt and i % 2 else self.router) + "/v1/completions",
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=60),
            ) as r:
                raw = await r.read()
                counts["requests"] += 1
                if r.status == 200 and b'"error"' not in raw:
                    counts["ok"] += 1
                    self.ok_ids.setdefault(scenario, []).append(r.headers["X-Request-Id"])
                elif r.status == 200 or "X-Kvgate-Node" in r.headers:
                    counts["engine_errors"] += 1  # the engine failed (mid-stream or before)
                elif r.status == 503 and _typed(raw):
                    counts["refused_503"] += 1
                elif r.status >= 500:
                    counts["errors_5xx"] += 1
                else:
                    counts[f"status_{r.status}"] += 1
        except (aiohttp.ClientError, TimeoutError):
            counts["requests"] += 1
            counts["connection_errors"] += 1

    async def run(self) -> None:
        i = 0
        while not self.stop:
            if self.paused:
                await asyncio.sleep(0.1)
                continue
            i += 1
            task = asyncio.create_task(self.one(GOOD[i % 2], i))
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)
            await asyncio.sleep(1.0 / self.rps)

    async def drain(self) -> None:
        while self.inflight:
            await asyncio.sleep(0.1)


def _typed(raw: bytes) -> bool:
    try:
        return orjson.loads(raw)["error"]["type"] in TYPED_503
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False


async def alive(router: str) -> bool:
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(router + "/health", timeout=aiohttp.ClientTimeout(total=3)) as r,
        ):
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def wait_ready(router: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(router + "/ready") as r:
                    body = await r.json(content_type=None)
                    if body.get("ready") and body.get("healthy_nodes", 0) >= 2:
                        return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"router not ready within {timeout_s} s")


def kill_pidfile(path: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(path.read_text().strip()), signal.SIGKILL)
        time.sleep(0.5)


class Chaos:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.ns = f"chaos{uuid.uuid4().hex[:6]}"
        self.infra = LocalInfra(kafka_port=KAFKA_PORT, redis_port=REDIS_PORT)
        self.local = Path(os.environ.get("KVGATE_LOCAL", DEPLOY.parent / ".local"))
        self.sup = Supervisor(tmp / "logs")
        self.front = ChdbFront(str(tmp / "ch")).__enter__()
        self.router = ""
        self.redis_port = REDIS_PORT  # where the reservations are counted
        self.nodes: dict[str, str] = {}

    # --- the cluster -------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        tenants = {
            GOOD[0]: {"name": "good-a", "priority": "normal"},
            GOOD[1]: {"name": "good-b", "priority": "normal"},
            FLOOD: {"name": "flood", "priority": "normal", "max_concurrency": 4},
            LOW: {"name": "low", "priority": "low"},
            HIGH: {"name": "high", "priority": "high"},
            PROBE: {"name": "probe", "priority": "high"},
            BURST: {"name": "burst", "priority": "normal", "weight": 100},
            STALL: {"name": "stall", "priority": "normal"},
            STREAMS: {"name": "streams", "priority": "normal"},
        }
        return {
            "KVGATE_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{KAFKA_PORT}",
            "KVGATE_KAFKA__NAMESPACE": self.ns,
            "KVGATE_KAFKA__PARTITIONS": "2",
            "KVGATE_REDIS__URL": REDIS_URL,
            "KVGATE_ADMISSION__BACKEND": "redis",
            "KVGATE_ADMISSION__LEASE_S": str(LEASE_S),
            "KVGATE_ADMISSION__SWEEP_INTERVAL_S": "1.0",
            "KVGATE_ADMISSION__REQUIRE_API_KEY": "true",
            "KVGATE_ADMISSION__TENANTS": json.dumps(tenants),
            "KVGATE_ROUTER__ADMIN_KEYS": json.dumps({ADMIN: "chaos"}),
            "KVGATE_ROUTER__GATEWAY_KEYS": json.dumps({GATEWAY: "chaos"}),
            "KVGATE_ROUTER__STREAM_WRITE_TIMEOUT_S": "30",
            "KVGATE_ROUTER__STALL_BUDGET_S": "2",
            "KVGATE_ROUTER__IDLE_TIMEOUT_S": "5",
            "KVGATE_ROUTER__DRAIN_GRACE_S": "2",
            "KVGATE_WORKER__WEB_PORT": str(free_port()),
            "KVGATE_WORKER__DATA_DIR": str(self.tmp / "worker"),
            "KVGATE_CLICKHOUSE__BACKEND": "server",
            "KVGATE_CLICKHOUSE__PORT": str(self.front.port),
            "KVGATE_CLICKHOUSE__COMPRESS": "false",
            "KVGATE_SINK__GROUP_ID": f"{self.ns}-sink",
            "KVGATE_SINK__BATCH_INTERVAL_S": "0.5",
        }

    async def start(self) -> None:
        self.infra.up("kafka")
        self.infra.up("redis")
        self.sup.env.update(self.env())
        await ensure_topics(
            KafkaSettings(
                bootstrap_servers=f"127.0.0.1:{KAFKA_PORT}", namespace=self.ns, partitions=2
            )
        )
        for node in ("n1", "n2"):
            self.nodes[node] = self.sup.spawn_node(node, 3000)
        self.sup.spawn("worker", "worker")
        self.sup.spawn("sink", "sink")
        port = free_port()
        self.sup.spawn("router", "router", "--port", str(port))
        self.router = f"http://127.0.0.1:{port}"
        await wait_ready(self.router)

    def stop(self) -> None:
        self.sup.stop_all()
        self.front.__exit__()
        self.infra.down()

    def restart(self, name: str, *argv: str) -> None:
        self.sup.kill(name)
        self.sup.spawn(name, *argv)

    async def reservations(self) -> int:
        client = Redis(port=self.redis_port)
        try:
            return int(await client.hlen(f"kvgate:{self.ns}:resv"))
        finally:
            await client.aclose()

    def decision_rows(self, ids: list[str]) -> tuple[int, int]:
        """(lost, duplicated) decision rows of these ok requests, read with FINAL."""
        if not ids:
            return 0, 0
        quoted = ",".join(f"'{i}'" for i in ids)
        raw = self.front._run(
            "SELECT request_id, count() FROM kvgate.decisions FINAL "
            f"WHERE request_id IN ({quoted}) AND decision_seq = 0 GROUP BY request_id",
            "CSV",
        )
        seen = {}
        for line in (raw or b"").decode().splitlines():
            rid, n = line.rsplit(",", 1)
            seen[rid.strip('"')] = int(n)
        lost = sum(1 for i in ids if i not in seen)
        duplicated = sum(n - 1 for n in seen.values() if n > 1)
        return lost, duplicated

    # --- scenarios ---------------------------------------------------------------------------
    async def broker_killed(self, load: Load) -> dict[str, Any]:
        kill_pidfile(self.local / "kafka" / f"kafka-{KAFKA_PORT}.pid")
        await asyncio.sleep(self.args.outage_s)
        res = await asyncio.to_thread(self.infra.run, "kafka", "start")
        return {"restart": res.returncode == 0}

    async def redis_restarted(self, load: Load) -> dict[str, Any]:
        kill_pidfile(self.local / "redis" / f"redis-{REDIS_PORT}.pid")
        await asyncio.sleep(2.0)
        res = await asyncio.to_thread(self.infra.run, "redis", "start")
        return {"restart": res.returncode == 0}

    async def worker_killed(self, load: Load) -> dict[str, Any]:
        self.restart("worker", "worker")
        return {}

    async def sink_killed(self, load: Load) -> dict[str, Any]:
        self.restart("sink", "sink")
        return {}

    async def _respawned(self, name: str) -> dict[str, Any]:
        """kill -9 a child, and start it again with the same command line 3 s later."""
        argv = [str(a) for a in self.sup.procs[name].popen.args]  # type: ignore[union-attr]
        self.sup.kill(name)
        await asyncio.sleep(3.0)
        self.sup.spawn_argv(name, argv)
        return {}

    async def agent_killed(self, load: Load) -> dict[str, Any]:
        return await self._respawned("agent-n1")

    async def engine_killed(self, load: Load) -> dict[str, Any]:
        return await self._respawned("engine-n1")

    async def stalled_readers(self, load: Load) -> dict[str, Any]:
        port = int(self.router.rsplit(":", 1)[1])
        body = orjson.dumps(
            {"model": MODEL, "prompt": "stall " * 40, "max_tokens": 4000, "stream": True}
        )
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: c\r\nAuthorization: Bearer {GOOD[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        socks = []
        for _ in range(self.args.stalled):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setblocking(False)
            with contextlib.suppress(OSError):
                s.bind((STALL_ADDR, 0))  # the stalled clients' own address
                await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
                s.send(head + body)
                socks.append(s)
        await asyncio.sleep(self.args.scenario_s)
        for s in socks:
            s.close()
        return {"stalled_clients": len(socks)}

    async def slow_headers(self, load: Load) -> dict[str, Any]:
        port = int(self.router.rsplit(":", 1)[1])
        conns = []
        for _ in range(self.args.slow):  # from an address of their own (the attacker's)
            with contextlib.suppress(OSError):
                r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(SLOW_ADDR, 0))
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: c\r\n")
                conns.append((r, w))
        for _ in range(int(self.args.scenario_s)):
            for _, w in conns:
                with contextlib.suppress(OSError):
                    w.write(b"X-Slow: 1\r\n")  # a header line a second, never the end
            await asyncio.sleep(1.0)

        async def closed(r: asyncio.StreamReader) -> bool:
            try:
                await asyncio.wait_for(r.read(), 0.5)  # EOF: the router closed it
            except TimeoutError:
                return False  # still open
            except ConnectionError:
                pass  # reset: the router closed it while we were still writing
            return True

        cut = sum(await asyncio.gather(*(closed(r) for r, _ in conns)))
        for _, w in conns:
            w.close()
        return {"slow_connections": len(conns), "closed_by_router": cut}

    async def huge_bodies(self, load: Load) -> dict[str, Any]:
        port = int(self.router.rsplit(":", 1)[1])
        statuses: Counter[str] = Counter()
        chunk = b"x" * (1 << 20)
        for creds in (None, GOOD[1]):
            for _ in range(self.args.huge):
                auth = f"Authorization: Bearer {creds}\r\n" if creds else ""
                head = (
                    f"POST /v1/completions HTTP/1.1\r\nHost: c\r\n{auth}"
                    f"Content-Type: application/json\r\nContent-Length: {64 << 20}\r\n\r\n"
                ).encode()
                try:
                    r, w = await asyncio.open_connection("127.0.0.1", port)
                    w.write(head)
                    for _ in range(64):  # send the body until the router closes on us
                        if w.is_closing():
                            break
                        w.write(chunk)
                        with contextlib.suppress(ConnectionError):
                            await asyncio.wait_for(w.drain(), 2.0)
                    line = await asyncio.wait_for(r.readline(), 5.0)
                    statuses[f"{'key' if creds else 'no_key'}_{line.split(b' ')[1].decode()}"] += 1
                    w.close()
                except (OSError, TimeoutError, IndexError):
                    statuses[f"{'key' if creds else 'no_key'}_closed"] += 1
        return {"answers": dict(statuses)}

    async def tenant_flood(self, load: Load) -> dict[str, Any]:
        counts: Counter[int] = Counter()

        async def flood_one(i: int) -> None:
            body = {"model": MODEL, "prompt": f"flood {i} " * 30, "max_tokens": 64, "stream": True}
            status = await post_status(load.http, self.router, FLOOD, json=body)
            if status is not None:
                counts[status] += 1

        end = time.monotonic() + self.args.scenario_s
        i = 0
        tasks: set[asyncio.Task[None]] = set()
        while time.monotonic() < end:  # 40 at a time: 10x its max_concurrency of 4
            while len(tasks) < 40:
                i += 1
                t = asyncio.create_task(flood_one(i))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        return {"flood_answers": {str(k): v for k, v in sorted(counts.items())}}

    async def baseline(self, load: Load) -> dict[str, Any]:
        await asyncio.sleep(self.args.scenario_s)
        return {}


SCENARIOS = [
    "baseline",
    "broker_killed",
    "redis_restarted",
    "worker_killed",
    "sink_killed",
    "agent_killed",
    "engine_killed",
    *STREAM_SCENARIOS,
    "stalled_readers",
    "slow_headers",
    "huge_bodies",
    "tenant_flood",
    *CLIENT_SCENARIOS,
    *STORE_SCENARIOS,  # the routers it starts serve the scenarios after it
    *FLEET_SCENARIOS,  # last: the engines it kills stay dead
]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-chaos-"))
    chaos = Chaos(args, tmp)
    rows = []
    try:
        await chaos.start()
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True)
        ) as http:
            load = Load(chaos.router, http, rps=args.rps)
            runner = asyncio.create_task(load.run())
            await asyncio.sleep(3.0)  # warm-up
            for name in args.scenarios:
                load.scenario = name
                started = time.monotonic()
                scenario = (
                    CLIENT_SCENARIOS.get(name)
                    or STREAM_SCENARIOS.get(name)
                    or STORE_SCENARIOS.get(name)
                    or FLEET_SCENARIOS.get(name)
                )
                extra = await (scenario(chaos, load) if scenario else getattr(chaos, name)(load))
                elapsed = time.monotonic() - started
                if elapsed < args.scenario_s:
                    await asyncio.sleep(args.scenario_s - elapsed)
                load.scenario = f"{name}/after"
                await asyncio.sleep(5.0)  # recovery, counted apart
                was_alive = await alive(chaos.router)
                # every request of the scenario ends; what Redis still holds after a lease leaked
                load.paused = True
                await load.drain()
                t0 = time.monotonic()
                while await chaos.reservations() and time.monotonic() - t0 < LEASE_S + 3.0:
                    await asyncio.sleep(0.5)
                leaked = await chaos.reservations()
                load.paused = False
                rows.append(
                    {
                        "name": name,
                        "extra": extra,
                        "router_alive": was_alive,
                        "leaked": leaked,
                        "released_within_s": round(time.monotonic() - t0, 1),
                    }
                )
                print(name, dict(load.results.get(name, {})), extra, flush=True)
            load.stop = True
            await runner
            await load.drain()
        await asyncio.sleep(10.0)  # the sink drains
        out = []
        for row in rows:
            name = row["name"]
            counts = load.results.get(name, Counter()) + load.results.get(
                f"{name}/after", Counter()
            )
            ids = load.ok_ids.get(name, []) + load.ok_ids.get(f"{name}/after", [])
            lost, duplicated = chaos.decision_rows(ids)
            out.append(
                {
                    "name": name,
                    "requests": counts["requests"],
                    "ok": counts["ok"],
                    "errors_5xx": counts["errors_5xx"],
                    "refused_503": counts["refused_503"],
                    "engine_errors": counts["engine_errors"],
                    "connection_errors": counts["connection_errors"],
                    "other": {k: v for k, v in counts.items() if k.startswith("status_")},
                    "leaked_reservations": row["leaked"],
                    "released_within_s": row["released_within_s"],
                    "lost_decisions": lost,
                    "duplicated_decisions": duplicated,
                    "router_alive": row["router_alive"],
                    **row["extra"],
                }
            )
        return {
            "command": "python -m tests.benchmarks.chaos " + " ".join(sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}",
            "date": time.strftime("%Y-%m-%d"),
            "rps": args.rps,
            "scenarios": out,
        }
    finally:
        chaos.stop()


def write(r: dict[str, Any]) -> None:
    """Writes chaos.json and chaos.md; a run of some scenarios keeps the others' rows from the
    file (each row says the command and date that measured it)."""
    OUT.mkdir(parents=True, exist_ok=True)
    for row in r["scenarios"]:
        row.setdefault("command", r["command"])
        row.setdefault("date", r["date"])
    path = OUT / "chaos.json"
    if path.exists():
        ran = {row["name"] for row in r["scenarios"]}
        kept = [
            {"command": old["command"], "date": old["date"], **row}
            for old in [json.loads(path.read_text())]
            for row in old["scenarios"]
            if row["name"] not in ran
        ]
        order = {name: i for i, name in enumerate(SCENARIOS)}
        r["scenarios"] = sorted(kept + r["scenarios"], key=lambda x: order.get(x["name"], 99))
    path.write_text(json.dumps(r, indent=2) + "\n")
    lines = [
        "# Chaos",
        "",
        f"`{r['command']}` on {r['machine']} ({r['date']}). A live cluster (2 simulated engines "
        f"with agents, worker, router with Redis reservations and {LEASE_S:.0f} s leases, sink "
        f"into ClickHouse) under {r['rps']} streamed requests/s from two well-behaved tenants; "
        "each scenario, then 5 s of recovery, counted together. Then the load pauses: `leaked` is "
        "what Redis still holds once every request of the scenario ended and a lease passed "
        "(`released_within_s`: how long the last reservations took to go); `lost` / "
        "`dup` compare the ok requests' minted ids with the decision rows in ClickHouse "
        "(`FINAL`).",
        "",
        "| scenario | requests | ok | 5xx | typed 503 | engine errors | conn. errors | leaked "
        "| released in (s) | lost | dup | router alive | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = {
        "name",
        "requests",
        "ok",
        "errors_5xx",
        "refused_503",
        "engine_errors",
        "connection_errors",
        "leaked_reservations",
        "released_within_s",
        "lost_decisions",
        "duplicated_decisions",
        "router_alive",
        "command",
        "date",
    }
    for s in r["scenarios"]:
        notes = {k: v for k, v in s.items() if k not in keys and v}
        lines.append(
            f"| {s['name']} | {s['requests']} | {s['ok']} | {s['errors_5xx']} | "
            f"{s['refused_503']} | {s['engine_errors']} | {s['connection_errors']} | "
            f"{s['leaked_reservations']} | {s['released_within_s']} | {s['lost_decisions']} | "
            f"{s['duplicated_decisions']} | "
            f"{'yes' if s['router_alive'] else 'NO'} | {json.dumps(notes) if notes else ''} |"
        )
    older = [s for s in r["scenarios"] if s["command"] != r["command"] or s["date"] != r["date"]]
    if older:
        lines += ["", "Rows kept from an earlier run:", ""]
        lines += [f"* {s['name']}: `{s['command']}` ({s['date']})" for s in older]
    (OUT / "chaos.md").write_text("\n".join(lines) + "\n")


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rps", type=float, default=8.0)
    p.add_argument("--scenario-s", type=float, default=20.0)
    p.add_argument("--outage-s", type=float, default=30.0)
    p.add_argument("--stalled", type=int, default=200)
    p.add_argument("--slow", type=int, default=500)
    p.add_argument("--huge", type=int, default=3)
    p.add_argument("--scenarios", nargs="*", default=SCENARIOS)
    p.add_argument("--quick", action="store_true", help="short scenarios (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.scenario_s, args.outage_s, args.stalled, args.slow, args.huge = 6.0, 8.0, 20, 50, 1
    r = asyncio.run(main(args))
    if not args.quick:
        write(r)
    else:
        print(json.dumps(r["scenarios"], indent=2))


if __name__ == "__main__":
    cli()
