"""kvgate's live router next to SGLang's model gateway, in front of the same simulated engines.

    pip install -e '.[peer]'    # sglang-router (the Rust gateway, from PyPI)
    python -m tests.benchmarks.livepeer [--workloads easy,loaded] [--engines 4]

The routers get the same workload, one after the other, with the engines' prefix caches reset
in between. Engines are small (``num_gpu_blocks``) so that the shared prompts do not all fit on
every engine: where a request goes decides whether its prefix is cached. The workloads
(:data:`WORKLOADS`), each on its own fresh set of engines:

* ``easy``: support-bot chat (``analytics.workloads.shared_prompt_chat``: long system prompts
  shared by short user turns, streamed answers), 40 prompts of ~600 words at 20 req/s on
  full-speed engines; both routers keep up.
* ``loaded``: fewer, longer prompts (~1,500 words) on engines with a slow prefill, at a rate
  near what the engines sustain when every prompt hits: a miss costs a long prefill, so where
  routing sends a request shows in the latency and in how much the engines keep up.
* ``approx``: the easy chat on engines that tokenize with a vocabulary kvgate is not given.
* ``agentic``: coding-agent sessions (AIPerf's agentic trace, scaled down; tests/benchmarks/
  liveagentic.py), 16 at once in closed loop on engines that hold a few contexts each; also
  sglang-router with its load balancing tuned for a few sessions.

Measured at the client: TTFT p50/p99, end-to-end p99, throughput, errors; measured at the
engines (vLLM's prefix-cache counters): the hit rate. Needs the Kafka that ``kvgate infra
start`` runs. Writes ``docs/benchmarks/livepeer.json`` and ``livepeer.md``; with ``--decisions
DIR`` also each kvgate run's decision records (JSON lines from Kafka: every candidate's cost
components), to see why a run went as it did.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from agents.enginemetrics import parse_metrics
from analytics.workloads import shared_prompt_chat
from deploy.procs import Supervisor, free_port
from tests.benchmarks.liveagentic import agentic_figures, drive_sessions
from tests.benchmarks.livepeer_report import write
from tests.benchmarks.livepeer_workloads import (
    ENGINE_TOKENIZER,
    EVENTS_OFF,
    MODEL,
    SGLANG_TUNED,
    SGLANG_TUNED_NAME,
    WORKLOADS,
    Workload,
    pct,
    report_header,
)

__all__ = ["ENGINE_TOKENIZER", "MODEL", "pct", "report_header", "wait_http"]


async def wait_http(url: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


async def engine_counters(
    http: aiohttp.ClientSession, engines: list[str]
) -> tuple[float, float, float]:
    """The engines' prefix-cache hits and queries (tokens) and preemptions (a KV-bound engine
    puts running requests back in its queue), summed over the engines."""
    hits = queries = preemptions = 0.0
    for url in engines:
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        stats = parse_metrics(text)
        hits += stats.prefix_hits_total
        queries += stats.prefix_queries_total
        preemptions += sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("vllm:num_preemptions_total")
        )
    return hits, queries, preemptions


async def reset_caches(http: aiohttp.ClientSession, engines: list[str]) -> None:
    """Wait until every engine is idle (the previous run's requests done, also those its
    client gave up on), then empty their prefix caches."""
    deadline = time.monotonic() + 300
    for url in engines:
        while True:
            async with http.get(url + "/metrics") as r:
                stats = parse_metrics(await r.text())
            if stats.running + stats.waiting == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} still busy after 300 s")
            await asyncio.sleep(0.5)
        for _ in range(200):
            async with http.post(url + "/reset_prefix_cache") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.1)


async def one(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    ttft = None
    try:
        async with http.post(
            url + "/v1/chat/completions", json=body, headers={"X-Request-Id": uuid.uuid4().hex}
        ) as r:
            if r.status != 200:
                await r.read()
                return {"ok": False, "status": r.status}
            async for line in r.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - started
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"ok": False, "status": type(exc).__name__}
    return {"ok": ttft is not None, "ttft_s": ttft, "e2e_s": time.perf_counter() - started}


async def router_counts(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """A kvgate router's decisions by reason (``decision/<reason>``: routed or refused — a
    refusal of routing names no node: ``no_fit_now``, ``nodes_unhealthy``…) and admission's
    refusals (``refused/<reason>``) so far; empty for a router without them."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with http.get(url + "/metrics") as r:
            if r.status != 200:
                return {}
            text = await r.text()
    except aiohttp.ClientError:
        return {}
    names = {"kvgate_router_decisions": "decision", "kvgate_router_rejections": "refused"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in names:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[f"{names[family.name]}/{sample.labels['reason']}"] = sample.value
    return out


async def _chat(
    http: aiohttp.ClientSession, url: str, w: Workload, seed: int
) -> tuple[list[dict[str, Any]], float, dict[str, Any]]:
    """The support-bot chat at ``w``'s rate: every request's result, the span, its figures."""
    specs = list(
        shared_prompt_chat(
            MODEL, w.rps, w.duration_s, bots=w.bots, system_words=w.system_words, seed=seed
        )
    )
    start = time.perf_counter()
    tasks = []
    for spec in specs:
        delay = spec.arrival_s - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(http, url, spec.body)))
    results = await asyncio.gather(*tasks)
    span = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
    figures = {
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "e2e_p99_s": pct(e2e, 0.99),
        "throughput_rps": len(ok) / span,
    }
    return results, span, figures


async def drive(url: str, engines: list[str], w: Workload, seed: int) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120 if w.agentic is None else 600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await reset_caches(http, engines)
        hits0, queries0, preempted0 = await engine_counters(http, engines)
        counts0 = await router_counts(http, url)
        if w.agentic is None:
            results, _, figures = await _chat(http, url, w, seed)
        else:
            tag = uuid.uuid4().hex[:8]
            results, span = await drive_sessions(
                http, url, MODEL, w.agentic, w.duration_s, seed, tag
            )
            figures = agentic_figures(results, span, len(engines))
        hits1, queries1, preempted1 = await engine_counters(http, engines)
        counts1 = await router_counts(http, url)
    ok = [r for r in results if r["ok"]]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_statuses": sorted({str(r["status"]) for r in results if not r["ok"]}),
        # kvgate's decisions and refusals of this run, by reason (its /metrics)
        "router_counts": {
            k: v - counts0.get(k, 0.0) for k, v in counts1.items() if v > counts0.get(k, 0.0)
        },
        "hit_rate": (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else 0.0,
        "engine_preemptions": preempted1 - preempted0,
        **figures,
    }


async def save_decisions(namespace: str, since: float, path: Path) -> int:
    """The decision records kvgate's routers wrote to Kafka since ``since`` (one JSON object a
    line, oldest first): what each request's candidates cost, to see why a run went as it did."""
    from deploy.settings import load_settings
    from streams.kafka import make_consumer
    from streams.topics import DECISIONS

    kafka = load_settings().kafka.model_copy(update={"namespace": namespace})
    consumer = make_consumer(
        kafka, DECISIONS.name(namespace), group_id=None, client_id="livepeer-decisions"
    )
    await consumer.start()
    rows: list[dict[str, Any]] = []
    try:
        quiet = 0
        while quiet < 5:
            got = await consumer.getmany(timeout_ms=400)
            quiet = 0 if got else quiet + 1
            for records in got.values():
                for r in records:
                    if r.value is not None:
                        row = json.loads(r.value)
                        if row.get("ts", 0) >= since:
                            rows.append(row)
    finally:
        await consumer.stop()
    rows.sort(key=lambda r: r["ts"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


async def main(args: argparse.Namespace, w: Workload, seed: int, rep: int) -> dict[str, Any]:
    """One repetition on fresh engines. The routers run one after the other, in an order
    rotated by ``rep`` (a router that always ran first, or always after the same one, would
    carry that into its figures); the approx workload's two kvgate runs each start with the
    agents started again (with KV events, or without) and a fresh router (:func:`fresh_kvgate`)."""
    sup, namespace = Supervisor.isolated("peer", {"KVGATE_ADMISSION__ENABLED": "false"})
    try:
        env: dict[str, str] = {}
        if w.prefill_tokens_per_s:
            env["KVGATE_ENGINE__PROFILE__PREFILL_TOKENS_PER_S"] = str(w.prefill_tokens_per_s)
        if w.engine_tokenizer:
            env["KVGATE_ENGINE__TOKENIZER"] = json.dumps(ENGINE_TOKENIZER)
        engines = [
            sup.spawn_node(f"node-{i}", num_gpu_blocks=w.num_gpu_blocks, engine_env=env)
            for i in range(args.engines)
        ]
        for url in engines:
            await wait_http(url + "/health")
        sup.spawn("worker", "worker")
        kv_port, sgl_port = free_port(), free_port()
        sup.spawn("router", "router", "--port", str(kv_port))
        routers = {
            "sglang_router_cache_aware": f"http://127.0.0.1:{sgl_port}",
            "kvgate": f"http://127.0.0.1:{kv_port}",
        }
        if w.prefill_tokens_per_s:  # a second kvgate told the engines' prefill rate up front
            told_port = free_port()
            rate = {"KVGATE_ROUTER__COST__PREFILL_TOKENS_PER_S": str(w.prefill_tokens_per_s)}
            sup.spawn("router-told", "router", "--port", str(told_port), env=rate)
            routers["kvgate_told_prefill_rate"] = f"http://127.0.0.1:{told_port}"
        sglang = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
        pick = ["--policy", "cache_aware", "--worker-urls", *engines]
        sup.spawn_argv("sglang-router", [*sglang, "--port", str(sgl_port), *pick])
        if w.agentic is not None:  # a few sessions at once: balanced at a few requests apart
            tuned_port = free_port()
            # its own metrics port (the first one holds sglang-router's default)
            metrics = ["--prometheus-port", str(free_port())]
            sup.spawn_argv(
                "sglang-router-tuned",
                [*sglang, "--port", str(tuned_port), *metrics, *pick, *SGLANG_TUNED],
            )
            routers[SGLANG_TUNED_NAME] = f"http://127.0.0.1:{tuned_port}"
        for name, url in routers.items():
            await wait_http(url + ("/v1/models" if name.startswith("sglang") else "/ready"))
        await asyncio.sleep(2.0)  # every agent has sent a few heartbeats
        runs: dict[str, Any] = {}
        wanted = [r for r in args.routers.split(",") if r in routers]
        if w.engine_tokenizer:  # with the agents' KV events and without, in turn
            wanted.append(EVENTS_OFF)
        order = wanted[rep % len(wanted) :] + wanted[: rep % len(wanted)] if wanted else []
        agents = {
            f"agent-node-{i}": list(sup.procs[f"agent-node-{i}"].popen.args)
            for i in range(len(engines))
        }
        for name in order:
            url = routers.get(name, "")
            if w.engine_tokenizer and name in ("kvgate", EVENTS_OFF):
                url = await fresh_kvgate(sup, agents, events=name == "kvgate", tag=name)
            since = time.time()
            runs[name] = await drive(url, engines, w, seed)
            print(name, json.dumps(runs[name]), flush=True)
            if args.decisions is not None and name.startswith("kvgate"):
                label = next(k for k, v in WORKLOADS.items() if v is w)
                path = args.decisions / f"{label}-rep{rep}-{name}.jsonl"
                print(f"  {await save_decisions(namespace, since, path)} decisions: {path}")
        return {"order": order, "runs": runs}
    finally:
        sup.stop_all()


async def fresh_kvgate(
    sup: Supervisor, agents: dict[str, list[str]], events: bool, tag: str
) -> str:
    """The agents started again, reading the engines' KV events or not (``kv_index:
    approximate``), and a fresh kvgate router; its URL. Both kvgate runs of the approx workload
    start so, in turn, so that neither carries the other's start or place in the order."""
    for name, argv in agents.items():
        sup.kill(name)
        sup.spawn_argv(name, argv if events else [*_without_events(argv), "--no-kv-events"])
    port = free_port()
    sup.spawn(f"router-{tag}", "router", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    await wait_http(url + "/ready")
    await asyncio.sleep(3.0)  # the new agents' heartbeats and KV snapshots
    return url


def _without_events(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--kv-events", "--kv-events-replay"):
            skip = True
        else:
            out.append(arg)
    return out


def cli() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repetitions", type=int, default=3, help="fresh engines each, seed + i")
    ap.add_argument(
        "--routers",
        default=f"sglang_router_cache_aware,{SGLANG_TUNED_NAME},kvgate,kvgate_told_prefill_rate",
    )
    ap.add_argument(
        "--decisions",
        type=Path,
        default=None,
        help="save each kvgate run's decision records here (JSON lines, one file a run)",
    )
    args = ap.parse_args()
    try:
        import sglang_router  # type: ignore[import-untyped,unused-ignore]  # noqa: F401
    except ImportError:
        sys.exit("sglang-router is not installed: pip install -e '.[peer]'")
    results: dict[str, list[dict[str, Any]]] = {}
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            sys.exit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        results[name] = []
        for i in range(args.repetitions):
            print(f"workload {name}, repetition {i}", flush=True)
            seed = args.seed + i
            results[name].append(
                {"seed": seed, **asyncio.run(main(args, WORKLOADS[name], seed, i))}
            )
    write(args, results)


if __name__ == "__main__":
    cli()
