"""kvgate's live router next to SGLang's model gateway, in front of the same simulated engines.

    pip install -e '.[peer]'    # sglang-router (the Rust gateway, from PyPI)
    python -m tests.benchmarks.livepeer [--workloads easy,loaded] [--engines 4]

Both routers get the same support-bot workload (``analytics.workloads.shared_prompt_chat``:
long system prompts shared by short user turns, streamed answers), one after the other, with
the engines' prefix caches reset in between. Engines are small (``num_gpu_blocks``) so that
the system prompts do not all fit on every engine: where a request goes decides whether its
prefix is cached. Two workloads (:data:`WORKLOADS`), each on its own fresh set of engines:

* ``easy``: 40 prompts of ~600 words at 20 req/s on full-speed engines; both routers keep up.
* ``loaded``: fewer, longer prompts (~1,500 words) on engines with a slow prefill, at a rate
  near what the engines sustain when every prompt hits: a miss costs a long prefill, so where
  routing sends a request shows in the latency and in how much the engines keep up.

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
import os
import platform
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agents.enginemetrics import parse_metrics
from analytics.workloads import shared_prompt_chat
from deploy.procs import Supervisor, free_port

OUT = Path("docs/benchmarks")
MODEL = "llama-3.1-8b"


@dataclass(frozen=True)
class Workload:
    rps: float
    duration_s: float
    bots: int
    system_words: int
    num_gpu_blocks: int
    prefill_tokens_per_s: float | None  # None: the engine profile's (25,000 tokens/s)
    about: str
    # the engines tokenize with a real tokenizer (a BPE vocabulary) that kvgate is not given:
    # its tokens are approximate; it runs with the agents' KV events and again without them
    engine_tokenizer: bool = False


WORKLOADS = {
    "easy": Workload(20.0, 40.0, 40, 600, 1200, None, "full-speed engines, both routers keep up"),
    "loaded": Workload(
        24.0,
        60.0,
        16,
        1500,
        1200,
        2000.0,
        "slow prefill: a miss costs ~1 s of an engine; near saturation even when prompts hit",
    ),
    "approx": Workload(
        20.0,
        40.0,
        40,
        600,
        1200,
        None,
        "engines tokenize with a BPE vocabulary kvgate is not given (approximate tokens), with "
        "the agents' KV events flowing and switched off, in turn",
        engine_tokenizer=True,
    ),
}
# the engines' tokenizer in the approx workload (a real BPE tokenizer.json, shipped inside the
# anthropic package: nothing is downloaded); the router is given none and finds none
ENGINE_TOKENIZER = {"tokenizer": "package:anthropic/tokenizer.json"}
EVENTS_OFF = "kvgate_events_off"


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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


async def drive(url: str, engines: list[str], w: Workload, seed: int) -> dict[str, Any]:
    specs = list(
        shared_prompt_chat(
            MODEL, w.rps, w.duration_s, bots=w.bots, system_words=w.system_words, seed=seed
        )
    )
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await reset_caches(http, engines)
        hits0, queries0, preempted0 = await engine_counters(http, engines)
        counts0 = await router_counts(http, url)
        start = time.perf_counter()
        tasks = []
        for spec in specs:
            delay = spec.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(http, url, spec.body)))
        results = await asyncio.gather(*tasks)
        span = time.perf_counter() - start
        hits1, queries1, preempted1 = await engine_counters(http, engines)
        counts1 = await router_counts(http, url)
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
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
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "e2e_p99_s": pct(e2e, 0.99),
        "throughput_rps": len(ok) / span,
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
        sup.spawn_argv(
            "sglang-router",
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(sgl_port),
                "--policy",
                "cache_aware",
                "--worker-urls",
                *engines,
            ],
        )
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


def report_header(module: str) -> dict[str, Any]:
    """Command, machine, date and the peer's version: the head of every peer benchmark file."""
    import importlib.metadata

    return {
        "command": f"python -m {module} " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "sglang_router_version": importlib.metadata.version("sglang-router"),
    }


KEYS = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "throughput_rps", "errors")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def medians(reps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per router, the median over the repetitions of each figure."""
    routers = [r for r in reps[0]["runs"]] if reps else []
    return {
        router: {
            k: _median(
                [rep["runs"][router][k] for rep in reps if rep["runs"][router].get(k) is not None]
            )
            for k in KEYS
        }
        for router in routers
        if all(router in rep["runs"] for rep in reps)
    }


def checks(name: str, reps: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The targets of kvgate at its defaults against sglang-router, per repetition, and (loaded)
    the median of kvgate against kvgate told the engines' prefill rate."""
    out: list[tuple[str, bool]] = []
    for i, rep in enumerate(reps):
        runs = rep["runs"]
        k, s = runs.get("kvgate"), runs.get("sglang_router_cache_aware")
        off = runs.get(EVENTS_OFF)
        if k is not None and off is not None:
            out.append(
                (
                    f"rep {i}: hit rate with KV events >= without them (approximate tokens)",
                    k["hit_rate"] >= off["hit_rate"],
                )
            )
        if k is None or s is None or off is not None:
            continue
        if name == "loaded":
            out += [
                (f"rep {i}: TTFT p50 <= sglang-router's", k["ttft_p50_s"] <= s["ttft_p50_s"]),
                (
                    f"rep {i}: TTFT p99 <= 0.8x sglang-router's",
                    k["ttft_p99_s"] <= 0.8 * s["ttft_p99_s"],
                ),
                (f"rep {i}: hit rate >= sglang-router's", k["hit_rate"] >= s["hit_rate"]),
            ]
        else:
            for key, worse in (("ttft_p50_s", 1.05), ("ttft_p99_s", 1.05)):
                out.append(
                    (f"rep {i}: {key} within 5 % of sglang-router's", k[key] <= worse * s[key])
                )
            out.append(
                (
                    f"rep {i}: hit rate within 5 % of sglang-router's",
                    k["hit_rate"] >= 0.95 * s["hit_rate"],
                )
            )
    med = medians(reps)
    if "kvgate" in med and "kvgate_told_prefill_rate" in med:
        k, t = med["kvgate"], med["kvgate_told_prefill_rate"]
        for key in ("ttft_p50_s", "ttft_p99_s"):
            out.append(
                (f"median {key} within 10 % of kvgate told the rate", k[key] <= 1.1 * t[key])
            )
        out.append(
            (
                "median hit rate within 10 % of kvgate told the rate",
                k["hit_rate"] >= 0.9 * t["hit_rate"],
            )
        )
    return out


def _table(runs: dict[str, dict[str, Any]]) -> str:
    return "\n".join(
        f"| {router} | " + " | ".join(_fmt(r.get(k)) for k in KEYS) + " |"
        for router, r in runs.items()
    )


def write(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    """``livepeer.json`` and ``livepeer.md``: the workloads of this run, and those of the file
    already there that this run did not repeat (each keeps its own command and date)."""
    header = report_header("tests.benchmarks.livepeer")
    path = OUT / "livepeer.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}
    kept = {
        name: {"command": earlier.get("command"), "date": earlier.get("date"), **wl}
        for name, wl in earlier.get("workloads", {}).items()
        if name in WORKLOADS and name not in results
    }
    ran = {
        name: {
            "command": header["command"],
            "date": header["date"],
            **asdict(WORKLOADS[name]),
            "repetitions": reps,
            "medians": medians(reps),
            "checks": [{"check": c, "met": met} for c, met in checks(name, reps)],
        }
        for name, reps in results.items()
    }
    workloads = {
        name: (ran.get(name) or kept[name]) for name in WORKLOADS if name in ran or name in kept
    }
    report = {**header, "engines": args.engines, "workloads": workloads}
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    (OUT / "livepeer.md").write_text(_markdown(report))


def _markdown(report: dict[str, Any]) -> str:
    head = f"| router | {' | '.join(KEYS)} |\n|---|{'---:|' * len(KEYS)}"
    parts = []
    for name, wl in report["workloads"].items():
        w, reps = WORKLOADS[name], wl["repetitions"]
        speed = (
            f"prefill {w.prefill_tokens_per_s:,.0f} tokens/s"
            if w.prefill_tokens_per_s
            else "the profile's prefill speed"
        )
        tables = "\n\n".join(
            f"Repetition {i} (seed {rep['seed']}, fresh engines; in the order "
            f"{', '.join(rep.get('order') or rep['runs'])}):\n\n{head}\n{_table(rep['runs'])}"
            for i, rep in enumerate(reps)
        )
        met = "\n".join(f"* {'met' if ok else '**not met**'}: {c}" for c, ok in checks(name, reps))
        parts.append(
            f"""## {name}: {w.about}

Command: `{wl["command"]}` ({wl["date"]})

{w.rps} req/s for {w.duration_s} s of support-bot chat ({w.bots} system prompts of
~{w.system_words} words, streamed answers); engines with {w.num_gpu_blocks} KV blocks of 16
tokens and {speed}.

Median over {len(reps)} repetitions:

{head}
{_table(medians(reps))}

{met}

{tables}
"""
        )
    return f"""# Live: kvgate's router next to SGLang's model gateway

Machine: {report["machine"]}; sglang-router
{report["sglang_router_version"]} (`--policy cache_aware`, its defaults). {report["engines"]}
simulated engines per workload and repetition, fresh for each repetition (the process starts
over: engines, agents, worker, routers), the same engines for every router of a repetition
(prefix caches reset in between). Everything — engines, agents, Kafka, the Faust worker, the
routers and the client — shares the machine's cores, so absolute latencies carry that noise;
compare the rows. `kvgate` runs at its defaults (the engines' prefill rate as its agents
measured it when they started, then as it learns it from its first streamed answers);
`kvgate_told_prefill_rate` (on workloads whose engines are slower than that) is told the
engines' rate in its configuration, as an operator who measured them would. The routers of a
repetition run in an order rotated from one repetition to the next. `approx`: the engines
tokenize with a BPE tokenizer the router is not given (nor finds), so its tokens are
approximate and the index (the engines' exact tokens) cannot match them; `kvgate` runs with
the agents' KV events flowing, `kvgate_events_off` without them (`--no-kv-events`); each of
the two starts with the agents started again and a fresh router, in the rotated order.

""" + "\n".join(parts)


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def cli() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repetitions", type=int, default=3, help="fresh engines each, seed + i")
    ap.add_argument(
        "--routers", default="sglang_router_cache_aware,kvgate,kvgate_told_prefill_rate"
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
