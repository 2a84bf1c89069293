"""How many streamed requests per second kvgate's router carries, against sglang-router and a
bare pass-through proxy, and the time to first token it adds at half of that.

    pip install -e '.[peer]'    # sglang-router (the Rust gateway, from PyPI)
    python -m tests.benchmarks.proxy [--engines 2] [--workers 1,2] [--duration 8]

One run, the same simulated engines for every target:

* ``direct``: the client spreads requests over the engines itself (no proxy: the ceiling of this
  machine's engines and client, and the baseline for added latency);
* ``bare``: an aiohttp pass-through proxy that only copies bytes (:mod:`tests.benchmarks.bareproxy`,
  on uvloop): the floor of a proxy written in Python; ``bare-wire``: the same on kvgate's own
  HTTP layer (router/wire), which kvgate's listeners and engine requests run on;
* ``kvgate`` (``kvgate-w<N>`` for each ``--workers`` count): the full path — authentication,
  admission against the cluster budget in Redis, routing on the tables, the relay, and the decision
  and outcome records to Kafka;
* ``kvgate-epp``: kvgate's endpoint picker on its default gRPC server (kvgate's own HTTP/2),
  driven as Envoy drives it (:mod:`tests.benchmarks.eppclient`); ``kvgate-epp-grpcio``: the same
  on grpcio's server; ``bare-epp-native`` and ``bare-epp``: ext_proc servers on each that answer
  the same exchange and do nothing else (:mod:`tests.benchmarks.bareepp`): the floor of a picker
  in Python, its CPU measured at the rate kvgate's picker on the same server is;
* ``sglang``: sglang-router ``cache_aware`` (Rust).

**Max rate.** Poisson arrivals of short streamed completions (4 tokens: the engine work is small,
so the proxy is what is measured) at rising offered rates (× ``--step`` from ``--start``) until a
rate is not sustained — sustained: no request failed and the requests completed at ≥ 95 % of
the rate they were sent at (Poisson: a point sends about, not exactly, its offered rate). A
failed point is tried once more before the ramp stops. The max rate is the highest sustained
one. The client is one process at one address standing in for all of a router's users, as an
ingress in front of it is: kvgate's routers exempt it from the per-client share of connections
(``router.connection_share_exempt``; near the knee the client holds more than the 256 one
address may, and kvgate's limit, not its capacity, ended the ramp); ``router.max_connections``
stays.

**Added TTFT.** At half of each target's max rate, the target and ``direct`` are run for
``--latency-duration`` s each; added p50 / p99 = the target's TTFT percentile minus direct's.

Everything (engines, agents, Kafka, Redis, the worker, the routers and the client) shares this
machine's cores, so every figure is relative to the others of the same run. Writes
``docs/benchmarks/proxy.json`` and ``proxy.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from deploy.procs import Proc, Supervisor, child_pids, free_port
from deploy.settings import load_settings
from streams.exceptions import StreamError
from streams.kafka import delete_namespace_topics
from tests.benchmarks.eppclient import EppClient
from tests.benchmarks.livepeer import MODEL, pct, report_header, wait_http
from tests.benchmarks.proxy_report import ACHIEVED, render, summarize

OUT = Path("docs/benchmarks")
EPP_KEY = "bench-epp-key"  # the gateway key the picker's router takes
PROMPTS = itertools.count()  # each request's prompt number, never the same twice in a run
HTTP_ERRORS: Counter[str] = Counter()  # why :func:`one`'s requests failed, so far


Send = Callable[[aiohttp.ClientSession, str, int], Coroutine[Any, Any, "float | None"]]


@dataclass
class Target:
    name: str
    urls: list[str]
    proc: Proc | None = None  # its process (for memory)
    send: Send | None = None  # one request to it (default: a streamed completion over HTTP)


async def one(http: aiohttp.ClientSession, url: str, i: int) -> float | None:
    """A short streamed completion; its TTFT, or None when it failed."""
    body = {
        "model": MODEL,
        "prompt": f"request {i}: say hello",
        "max_tokens": 4,
        "stream": True,
    }
    started = time.perf_counter()
    ttft = None
    done = False
    try:
        async with http.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                got = await r.read()
                try:  # the error's type (its message may carry numbers: one key each)
                    error = json.loads(got)["error"]
                    why = str(error.get("type") or error.get("message"))[:60]
                except (ValueError, KeyError, TypeError, AttributeError):
                    why = "unreadable body"
                HTTP_ERRORS[f"{r.status} {why}"] += 1
                return None
            async for line in r.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - started
                elif line.startswith(b"data: [DONE]"):
                    done = True
    except (aiohttp.ClientError, TimeoutError) as exc:
        HTTP_ERRORS[type(exc).__name__] += 1
        return None
    if not done:
        HTTP_ERRORS["stream without [DONE]"] += 1
    return ttft if done else None


async def run_rate(
    urls: list[str], rate: float, duration: float, seed: int, send: Send | None = None
) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` for ``duration`` s, spread round-robin over ``urls``, each
    sent with ``send`` (default: :func:`one`)."""
    send = send or one
    # why requests failed: the picker's client counts its own, :func:`one` in HTTP_ERRORS
    counted = (
        HTTP_ERRORS if send is one else getattr(getattr(send, "__self__", None), "errors", None)
    )
    before = dict(counted or {})
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        arrivals.append(t)
    targets = itertools.cycle(urls)
    lag: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=30)
    ) as http:
        start = time.perf_counter()
        tasks = []
        for at in arrivals:
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            lag.append(max(0.0, -delay))
            # a prompt no earlier request of the run sent: the same prompt again is a client's
            # retry, and kvgate's retry-storm guard takes it for one (the ramp retries a
            # failed point with the prompts it has just sent)
            tasks.append(asyncio.create_task(send(http, next(targets), next(PROMPTS))))
        results = await asyncio.gather(*tasks)
        span = max(duration, time.perf_counter() - start)
    ok = [r for r in results if r is not None]
    return {
        "offered_rps": round(rate, 1),
        "sent_rps": len(results) / duration,  # the Poisson sample's own rate
        "requests": len(results),
        "errors": len(results) - len(ok),
        "achieved_rps": len(ok) / span,
        "ttft_p50_ms": (pct(ok, 0.5) or 0.0) * 1e3,
        "ttft_p99_ms": (pct(ok, 0.99) or 0.0) * 1e3,
        "client_lag_p99_ms": (pct(lag, 0.99) or 0.0) * 1e3,
        **(
            {
                "error_reasons": {
                    k: v - before.get(k, 0) for k, v in counted.items() if v > before.get(k, 0)
                }
            }
            if counted is not None
            else {}
        ),
    }


async def wait_tcp(address: str, timeout_s: float = 30.0) -> None:
    """Until ``host:port`` accepts a connection."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
            continue
        writer.close()
        await writer.wait_closed()
        return


def sustained(point: dict[str, Any]) -> bool:
    """Nothing failed, and what was sent completed at ≥ 95 % of the rate it was sent at (the
    requests finished within about 5 % more time than they took to send)."""
    return point["errors"] == 0 and point["achieved_rps"] >= ACHIEVED * point["sent_rps"]


async def max_rate(t: Target, args: argparse.Namespace) -> tuple[float, list[dict[str, Any]]]:
    """The highest sustained offered rate of the ramp, and every point measured."""
    points: list[dict[str, Any]] = []
    best, rate, retried = 0.0, args.start, False
    while rate <= args.ceiling:
        point = await run_rate(t.urls, rate, args.duration, args.seed + len(points), t.send)
        point["sustained"] = sustained(point)
        points.append(point)
        print(t.name, json.dumps(point), flush=True)
        await asyncio.sleep(1.0)  # engines and proxies drain
        if point["sustained"]:
            best, rate, retried = rate, rate * args.step, False
        elif not retried:
            retried = True  # a single stall of a shared core is not the proxy's limit
        else:
            break
    return best, points


async def added_latency(
    t: Target, direct: Target, rate: float, args: argparse.Namespace
) -> dict[str, Any]:
    """The target and direct at ``rate``, one after the other; the target's TTFT minus
    direct's, and the CPU the target's processes spent per request meanwhile."""
    d = await run_rate(direct.urls, rate, args.latency_duration, args.seed)
    await asyncio.sleep(1.0)
    before = cpu_s(t.proc.pid) if t.proc is not None else 0.0
    x = await run_rate(t.urls, rate, args.latency_duration, args.seed, t.send)
    spent = cpu_s(t.proc.pid) - before if t.proc is not None else 0.0
    await asyncio.sleep(1.0)
    return {
        "rate_rps": round(rate, 1),
        "direct": d,
        "target": x,
        "added_ttft_p50_ms": x["ttft_p50_ms"] - d["ttft_p50_ms"],
        "added_ttft_p99_ms": x["ttft_p99_ms"] - d["ttft_p99_ms"],
        "cpu_ms_per_request": 1e3 * spent / max(1, x["requests"]),
    }


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(child_pids(p))
    return out


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, MiB."""
    total = 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its descendants so far."""
    return sum(cpu_times(pid))


def cpu_times(pid: int) -> tuple[float, float]:
    """CPU seconds of ``pid`` and its descendants so far: (user, system)."""
    tick, user, system = os.sysconf("SC_CLK_TCK"), 0, 0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user, system = user + int(fields[11]), system + int(fields[12])
    return user / tick, system / tick


async def main(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        sys.exit("sglang-router is not installed: pip install -e '.[peer]'")
    sup, namespace = Supervisor.isolated("proxy")
    result: dict[str, Any] = {"targets": {}}
    epp = EppClient(EPP_KEY, MODEL)
    port_of: dict[str, int] = {}  # the picker's router: its HTTP port (for /ready)
    try:
        engines = [sup.spawn_node(f"node-{i}") for i in range(args.engines)]
        for url in engines:
            await wait_http(url + "/health")
        sup.spawn("worker", "worker")
        targets = [Target("direct", engines)]
        port = free_port()
        bare_argv = [sys.executable, "-m", "tests.benchmarks.bareproxy", "--uvloop"]
        bare = sup.spawn_argv("bare", [*bare_argv, "--port", str(port), *engines])
        targets.append(Target("bare", [f"http://127.0.0.1:{port}"], bare))
        port = free_port()
        wire = sup.spawn_argv("bare-wire", [*bare_argv, "--wire", "--port", str(port), *engines])
        targets.append(Target("bare-wire", [f"http://127.0.0.1:{port}"], wire))
        for n in args.workers:
            port = free_port()
            proc = sup.spawn(
                f"kvgate-w{n}",
                "router",
                "--port",
                str(port),
                "--workers",
                str(n),
                env={
                    "KVGATE_ADMISSION__BACKEND": "redis",  # what several routers share
                    # the client is every user at one address, as an ingress is
                    "KVGATE_ROUTER__CONNECTION_SHARE_EXEMPT": json.dumps(["127.0.0.1/32"]),
                },
            )
            targets.append(Target(f"kvgate-w{n}", [f"http://127.0.0.1:{port}"], proc))
        # the endpoint picker: kvgate's share when Envoy proxies (the ext_proc exchange), on
        # kvgate's own HTTP/2 (router.epp_transport: native, the default) and on grpcio's
        for name, transport in (("kvgate-epp", "native"), ("kvgate-epp-grpcio", "grpcio")):
            port, epp_port = free_port(), free_port()
            picker_proc = sup.spawn(
                name,
                "router",
                "--port",
                str(port),
                env={
                    "KVGATE_ADMISSION__BACKEND": "redis",
                    "KVGATE_ROUTER__EPP_PORT": str(epp_port),
                    "KVGATE_ROUTER__EPP_TRANSPORT": transport,
                    "KVGATE_ROUTER__EPP_KEYS": json.dumps({EPP_KEY: "bench-gateway"}),
                },
            )
            port_of[name] = port
            targets.append(Target(name, [f"127.0.0.1:{epp_port}"], picker_proc, epp.send))
        # the floor of a picker in Python: the same exchange answered and nothing else
        port = free_port()
        hosts = [e.removeprefix("http://").rstrip("/") for e in engines]
        bare_epp_argv = [sys.executable, "-m", "tests.benchmarks.bareepp", "--port", str(port)]
        bare_epp = sup.spawn_argv("bare-epp", [*bare_epp_argv, *hosts])
        targets.append(Target("bare-epp", [f"127.0.0.1:{port}"], bare_epp, epp.send))
        port = free_port()
        native_argv = [*bare_epp_argv[:-2], "--native", "--port", str(port), *hosts]
        bare_native = sup.spawn_argv("bare-epp-native", native_argv)
        targets.append(Target("bare-epp-native", [f"127.0.0.1:{port}"], bare_native, epp.send))
        port = free_port()
        launch = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
        launch += ["--port", str(port), "--policy", "cache_aware", "--worker-urls", *engines]
        sgl = sup.spawn_argv("sglang-router", launch)
        targets.append(Target("sglang", [f"http://127.0.0.1:{port}"], sgl))
        for t in targets[1:]:
            if t.name.startswith("bare-epp"):
                await wait_tcp(t.urls[0])
                continue
            if t.send is not None:  # the picker: its router's HTTP listener says when
                await wait_http(f"http://127.0.0.1:{port_of[t.name]}/ready")
                continue
            probe = {"sglang": "/v1/models", "bare": "/health", "bare-wire": "/health"}.get(
                t.name, "/ready"
            )
            await wait_http(t.urls[0] + probe)
        await asyncio.sleep(2.0)
        if args.targets:
            targets = [t for t in targets if t.name in args.targets or t.name == "direct"]
        for t in targets:  # connections, topic metadata, caches
            await run_rate(t.urls, 20.0, 2.0, args.seed + 1)
        direct = targets[0]
        for t in targets:
            best, points = await max_rate(t, args)
            entry: dict[str, Any] = {"max_rps": round(best, 1), "points": points}
            if t.proc is not None:
                entry["rss_mb"] = round(rss_mb(t.proc.pid), 1)
            result["targets"][t.name] = entry
        for t in targets[1:]:
            best = result["targets"][t.name]["max_rps"]
            # the bare picker at the rate kvgate's picker is measured at (CPU per request
            # falls with the rate: batching amortizes), so that the two compare
            kin = {"bare-epp": "kvgate-epp-grpcio", "bare-epp-native": "kvgate-epp"}
            picker = result["targets"].get(kin.get(t.name, ""), {}).get("at_half_rate")
            if picker is not None:
                best = 2 * picker["rate_rps"]
            if best > 0:
                half = await added_latency(t, direct, best / 2, args)
                result["targets"][t.name]["at_half_rate"] = half
                print(t.name, "half", json.dumps(half), flush=True)
    finally:
        await epp.close()
        sup.stop_all()
        await drop_topics(namespace)
    return summarize(result)


async def drop_topics(namespace: str) -> None:
    """A run's topics deleted: a broker keeping every run's topics slows the next (a failure is
    reported, never raised over why the run ended)."""
    kafka = load_settings().kafka.model_copy(update={"namespace": namespace})
    try:
        await delete_namespace_topics(kafka)
    except StreamError as exc:
        print(f"topics of {namespace} left behind: {exc}", file=sys.stderr)


def write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    report = {
        **report_header("tests.benchmarks.proxy"),
        "engines": args.engines,
        "duration_s_per_point": args.duration,
        **result,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "proxy.json").write_text(json.dumps(report, indent=2) + "\n")
    (OUT / "proxy.md").write_text(render(report))


def rewrite() -> None:
    """Regenerate proxy.md from proxy.json (same numbers)."""
    report = json.loads((OUT / "proxy.json").read_text())
    (OUT / "proxy.md").write_text(render(report))


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def cli() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--workers", type=_ints, default=[1, 2], help="kvgate router workers")
    ap.add_argument("--start", type=float, default=50.0, help="first offered rate, req/s")
    ap.add_argument("--step", type=float, default=1.25, help="rate factor between points")
    ap.add_argument("--ceiling", type=float, default=3000.0, help="highest rate tried")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per ramp point")
    ap.add_argument("--latency-duration", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--targets",
        type=lambda v: [x for x in v.split(",") if x],
        default=[],
        help="only these (and direct); the report is printed, not written",
    )
    args = ap.parse_args()
    from router.serve import event_loop_factory

    # the client on uvloop too: it shares the cores with what it measures
    with asyncio.Runner(loop_factory=event_loop_factory("auto")) as runner:
        result = runner.run(main(args))
    if args.targets:
        print(json.dumps(result, indent=2))
        return
    write(args, result)


if __name__ == "__main__":
    cli()
