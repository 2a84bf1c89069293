"""The pipeline benchmark's report: ``docs/benchmarks/pipeline.json`` and ``pipeline.md`` from
the result of ``python -m tests.benchmarks.pipeline``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def _step_table(
    steps: list[dict[str, Any]], key: str = "meets_1s_p99", title: str = "≤ 1 s p99"
) -> list[str]:
    lines = [
        "| nodes | offered msgs/s | block changes/s | hb p50 / p99 ms | block p50 / p99 ms "
        f"| blocks seen | worker CPU | replica CPU | {title} |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for s in steps:
        lines.append(
            f"| {s['nodes']} | {s['offered_msgs_per_s']} | "
            f"{s['offered_block_changes_per_s']:.0f} | "
            f"{s['heartbeat_p50_ms']} / {s['heartbeat_p99_ms']} | {s['block_p50_ms']} / "
            f"{s['block_p99_ms']} | {s['blocks_seen_ratio']:.0%} | "
            f"{s['worker_cpu_share']:.0%} | {s['replica_cpu_share']:.0%} | "
            f"{'yes' if s[key] else 'no'} |"
        )
    return lines


def _cost_lines(result: dict[str, Any]) -> list[str]:
    cost = result.get("worker_cost")
    if not cost:
        return []
    cur, base = cost["current"], cost["baseline"]
    lines = [
        "## Worker CPU per 1,000 block changes",
        "",
        f"The same load ({cur['nodes']} nodes, {cur['offered_msgs_per_s']} msgs/s, "
        f"{cur['block_changes']} block changes) against this worker and against the worker of "
        f"revision `{cost['baseline_rev']}` (one changelog record per block change and per "
        "heartbeat), one after the other in this run; CPU of the worker process from the "
        "start of the load to the end of its drain.",
        "",
        "| worker | CPU s | CPU share | CPU s per 1,000 block changes |",
        "|---|---:|---:|---:|",
        f"| this revision | {cur['worker_cpu_s']} | {cur['worker_cpu_share']:.0%} | "
        f"{cur['worker_cpu_s_per_1000_changes']} |",
    ]
    if base:
        lines.append(
            f"| `{cost['baseline_rev']}` | {base['worker_cpu_s']} | "
            f"{base['worker_cpu_share']:.0%} | {base['worker_cpu_s_per_1000_changes']} |"
        )
    lines += ["", f"**Reduction: {cost['reduction']}×** (target ≥ 10×).", ""]
    return lines


def _scaleout_lines(result: dict[str, Any]) -> list[str]:
    so = result.get("scaleout")
    if not so:
        return []
    one, two = so["one_worker"], so["two_workers"]
    shares = ", ".join(f"{v:.0%}" for v in two["worker_cpu_shares"].values())
    return [
        "## Two workers",
        "",
        f"{so['nodes']} nodes on {so['partitions']} partitions, the tables read back "
        "(read_committed), once with one worker and once with two in one consumer group.",
        "",
        "| workers | worker CPU | hb p99 ms | block p99 ms | blocks seen | keeps up |",
        "|---:|---|---:|---:|---:|:---:|",
        f"| 1 | {one['worker_cpu_share']:.0%} | {one['heartbeat_p99_ms']} | "
        f"{one['block_p99_ms']} | {one['blocks_seen_ratio']:.0%} | "
        f"{'yes' if one['keeps_up'] else 'no'} |",
        f"| 2 | {shares} | {two['heartbeat_p99_ms']} | {two['block_p99_ms']} | "
        f"{two['blocks_seen_ratio']:.0%} | {'yes' if two['keeps_up'] else 'no'} |",
        "",
        f"**worker_scaleout_ratio = {so['ratio']}**: the load one worker carries per CPU "
        "second, with two workers, divided by the busiest of the two's CPU (each would have a "
        "core of its own in a deployment; here both share two cores with the broker). Target "
        "≥ 1.7.",
        "",
    ]


def _restart_lines(result: dict[str, Any]) -> list[str]:
    r = result.get("restart")
    if not r:
        return []
    return [
        "## Router restart",
        "",
        f"{r['nodes']} nodes publishing; a router (admission off, so that readiness depends on "
        "the tables alone) is started, killed with SIGKILL and started again.",
        "",
        "| | seconds to /ready |",
        "|---|---:|",
        f"| first start | {r['first_start_ready_s']} |",
        f"| restart after kill -9 | {r['restart_ready_s']} |",
        "",
        f"It then held {r['indexed_blocks']} blocks of {r['healthy_nodes']} healthy nodes. "
        "Target ≤ 10 s. The router reads the changelogs keeping the last record per key, then "
        "restores each node from its base and deltas (as the worker restores its table): a "
        "changelog not yet compacted holds many rewrites per node, which it does not fold.",
        "",
    ]


def write(result: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "pipeline.json").write_text(json.dumps(result, indent=2) + "\n")
    kv = result["kv_batch"]
    o = result["router_overhead"] or {}
    lines = [
        "# Pipeline benchmark",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}; date {result['date']}; worker exactly_once="
        f"{result['exactly_once']}; {result['partitions']} partitions. Kafka, the Faust worker, "
        "the load generator and the measuring replica all share the machine's 2 cores.",
        "",
        "Load per simulated node: a heartbeat every "
        f"{result['heartbeat_interval_s']} s and a KV batch every {kv['interval_s']} s with "
        f"{kv['stored']} blocks stored and {kv['removed']} removed (80 block changes/s: about "
        "2.5 requests/s of 256 new prompt+output tokens each, at 16 tokens per block). "
        "Freshness = time from the message's production to its visibility in the replica, per "
        "heartbeat and per stored block; steps of "
        f"{result['steps'][0]['duration_s'] if result['steps'] else '?'} s, the first seconds "
        "left out.",
        "",
        f"**max_nodes = {result['max_nodes']}** — the largest node count whose heartbeats and "
        "KV blocks were visible in a router's replica within 1 s at p99 "
        f"(p99 there: {result['freshness_p99_ms_at_max_nodes']} ms). Target ≥ 1,000 nodes.",
        "",
        "## A router's replica (bootstrapped from the tables, then folding the input)",
        "",
        *_step_table(result["steps"]),
        "",
        "## The worker's tables alone (changelogs, read_committed)",
        "",
        f"max_nodes_tables = {result['max_nodes_tables']}: the largest node count the worker "
        "keeps up with, judged against 1 s plus one exactly-once commit interval "
        f"({result['commit_interval_s']} s), because a read_committed reader sees a table write "
        "only when the worker's transaction commits (the freshness-vs-exactly-once trade-off).",
        "",
        *_step_table(result["steps_tables"], "keeps_up", "keeps up"),
        "",
        "The worker's tables cost per node and commit interval, not per block: the prefix "
        "index is one segment record per changed node per interval (a base of the node's "
        "blocks and up to 16 delta slots, `streams/segments.py`), the load table the latest "
        "heartbeat per node, the ledger the last state per reservation. Each input record is "
        "folded as Faust's consumer hands it out, past Faust's streams and acknowledgements "
        "(`streams/faustpatch.py`, `fold_input_inline`), and a commit's table records leave as "
        "one record batch per changelog partition in its transaction (`streams/faustcommit.py`, "
        "`send_table_records`). The simulated fleet (a separate process on the same cores) "
        "sends each round of messages as one record batch per partition.",
        "",
        *_cost_lines(result),
        *_scaleout_lines(result),
        *_restart_lines(result),
    ]
    if o:
        lines += [
            "## Router overhead (TTFT through the router minus TTFT direct to the engine)",
            "",
            f"{o['requests']} sequential streamed requests (~600 prompt tokens, distinct per "
            "request so that no prefix is cached; 8 output tokens), "
            "alternating direct and routed, one simulated engine.",
            "",
            "| | p50 ms | p99 ms |",
            "|---|---:|---:|",
            f"| direct | {o['direct_ttft_p50_ms']} | {o['direct_ttft_p99_ms']} |",
            f"| through router | {o['router_ttft_p50_ms']} | {o['router_ttft_p99_ms']} |",
            f"| overhead | {o['overhead_ttft_p50_ms']} | {o['overhead_ttft_p99_ms']} |",
            "",
            f"Median of paired differences: {o['paired_overhead_median_ms']} ms.",
            "",
        ]
    lines += _guarantees(result.get("guarantees"))
    (OUT / "pipeline.md").write_text("\n".join(lines))


def _guarantees(g: dict[str, Any] | None) -> list[str]:
    """The exactly-once against at-least-once section (``--modes guarantees``)."""
    if not g:
        return []
    rows = [
        f"| {name.replace('_', '-')} | {m['block_p50_ms']} | {m['block_p99_ms']} | "
        f"{m['heartbeat_p99_ms']} | {'yes' if m['keeps_up'] else 'no'} | "
        f"{m['worker_cpu_share']} | {m['worker_cpu_s_per_1000_changes']} |"
        for name in ("exactly_once", "at_least_once")
        for m in [g[name]]
    ]
    nodes = g["exactly_once"]["nodes"]
    return [
        "",
        "## Exactly-once (the default) against at-least-once",
        "",
        f"`{g['command']}` ({g['date']}). The worker's tables at {nodes} nodes (freshness as a "
        "read_committed reader of the changelogs sees it) and its CPU per 1,000 block changes at "
        "the cost load, in each `worker.exactly_once` setting, fresh namespaces one after the "
        "other, one run each. Exactly-once commits the input offsets and the table writes in "
        "one Kafka transaction every `worker.commit_interval_s`: a reader sees the writes at "
        "the commit, so freshness carries up to one interval more; at-least-once flushes "
        "before each commit "
        "and relies on the idempotent folds.",
        "",
        "| guarantee | block p50 ms | block p99 ms | heartbeat p99 ms | keeps up | worker CPU "
        "share | worker CPU s / 1,000 changes |",
        "|---|---:|---:|---:|---|---:|---:|",
        *rows,
        "",
    ]
