"""``agentic.md``: the agentic benchmark's report (analytics/sim/agenticbench.py measures it)."""

from __future__ import annotations

from typing import Any

from analytics.sim.agenticsweep import sweep_markdown
from analytics.sim.bench_report import fmt
from router.decision.policies import grid_points

__all__ = ["agentic_markdown"]


KEYS = (
    "tok_s_per_gpu",
    "tok_s_per_user",
    "hit_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "slow_sessions",
    "refused",
)
COUNTS = frozenset({"refused", "slow_sessions"})  # medians of counts, shown whole


def _tuned_points(r: dict[str, Any]) -> str:
    tuned = r.get("tuned") or {}
    return "; ".join(
        f"{peer} "
        + ", ".join(f"`{k}` {fmt(v)}" for k, v in t["best"].items())
        + (" (its defaults)" if t["best"] == grid_points(peer)[0] else "")
        for peer, t in tuned.items()
    )


def _share(tokens: float, kv: float) -> str:
    return f"{tokens / 1e6:.2f}M context tokens, {tokens / kv:.2f}× the cluster's KV"


def _open_loop_prose(r: dict[str, Any]) -> str:
    """What the open loop shows and what it cannot: its load bounds everyone's throughput."""
    med, kv = r["median"], r["cluster_kv_tokens"]
    rr = med["round_robin"]["tok_s_per_gpu"]
    best = max((p for p in med if p != "round_robin"), key=lambda p: med[p]["tok_s_per_gpu"])
    peak = med["kvgate"]["contexts_peak_tokens"]
    un, bound, gain = r["uncontended"], r["tok_s_per_gpu_vs_rr_bound"], r["tok_s_per_gpu_vs_rr"]
    return f"""\
At the peak of kvgate's runs the sessions alive at once hold {_share(peak, kv)}
({kv / 1e6:.2f}M tokens): a router that keeps each session on the node holding its context
serves most turns from cache, and the tail is a turn queued behind another session's long
prefill. The sessions' own pace bounds the work (a turn waits for its tool) and every router is
offered the same turns, so tokens per GPU differ only by how soon each router's last sessions
end: the most any router reaches against round-robin is
{fmt(med[best]["tok_s_per_gpu"] / rr)} (`{best}`), and none can pass
{fmt(bound)}: on a cluster {un["nodes"] // r["nodes"]}× as large, where no turn waits and each
is served from its session's cache, the same sessions end only that much sooner than under
round-robin (`uncontended` in `agentic.json`; per repetition {", ".join(map(fmt, un["bounds"]))}).
kvgate's {fmt(gain)} is {(gain - 1) / max(1e-9, bound - 1):.0%} of the gain there is to make.
The capacity the load is a share of is
least-requests' (every request queued at once), whose hit rate is round-robin's: round-robin
runs near its limit here, the cache-aware routers far below theirs."""


def _overflow_prose(r: dict[str, Any]) -> str:
    """Why kvgate's tail, where the sessions alive need more KV than the cluster has."""
    kv = r["cluster_kv_tokens"]
    conc = r["at_concurrency"]
    runs = conc["runs"]
    peak = runs["kvgate"]["contexts_peak_tokens"]
    kg = runs["kvgate"]
    tail = min(
        (p for p in runs if p not in ("kvgate", "round_robin")), key=lambda p: runs[p]["ttft_p99_s"]
    )
    t = runs[tail]
    return f"""\
With {conc["sessions_at_once"]} sessions at once the sessions alive hold up to
{_share(peak, kv)}, so some contexts cannot be kept whatever the routing. kvgate places a
long-context session where resident contexts leave it room, and where no node has room on the
node most committed already (`cost.resident_fill`, router/decision/residency.py): the other
nodes keep their contexts whole (hit rate, tokens per user and TTFT p50 follow), and the sessions
that overflowed wait in that node's queue — the TTFT tail, and `slow_sessions` (sessions whose
turns' median TTFT is over 30 s) says how many they are. A cache-first router does the same by
accident (the node its first turns go to holds the excess); a router spreading load spreads the
misses over every session instead. kvgate bounds that queue (`cost.resident_overflow_wait_s`):
past it a second node takes the overflow, and a turn on the overflow node moves where it starts
`cost.resident_move_gain` × sooner (`session_move`), which shortens the queue for the sessions
that stay and costs the moved context's hits. Of the others the shortest tail here is
`{tail}`'s: TTFT p99 {fmt(t["ttft_p99_s"])} s against kvgate's {fmt(kg["ttft_p99_s"])} s, tokens
per GPU {fmt(t["tok_s_per_gpu"])} against {fmt(kg["tok_s_per_gpu"])}, hit rate
{fmt(t["hit_rate"])} against {fmt(kg["hit_rate"])}, tokens per user {fmt(t["tok_s_per_user"])}
against {fmt(kg["tok_s_per_user"])}."""


def _cells(m: dict[str, Any], keys: tuple[str, ...] = KEYS) -> str:
    return " | ".join(fmt(int(m[k]) if k in COUNTS else m[k]) for k in keys)


def _run_rows(runs: dict[str, dict[str, Any]]) -> str:
    """One row per router of a section run once each (no spread to show)."""
    return "\n".join(f"| {p} | {_cells(m)} | |" for p, m in runs.items())


def agentic_markdown(r: dict[str, Any]) -> str:
    keys = KEYS
    head = (
        "| router | "
        + " | ".join(keys)
        + " | spread of tok/s/GPU |\n|---|"
        + "---:|" * (len(keys) + 1)
    )
    rows = []
    for p, m in r["median"].items():
        gpu = [run["tok_s_per_gpu"] for run in r["runs"][p]]
        rows.append(f"| {p} | {_cells(m)} | {fmt(min(gpu))}–{fmt(max(gpu))} |")
    sat, conc = r["all_sessions_at_once"], r["at_concurrency"]
    sat_rows, conc_rows = _run_rows(sat["runs"]), _run_rows(conc["runs"])
    larger_rows = _run_rows(r["larger_kv"]["runs"])
    crit = "\n".join(
        f"| `{k}` | {fmt(r[k])} | {r['targets'][k]} | {'met' if r['met'][k] else '**not met**'} |"
        for k in r["targets"]
    )
    return f"""# Agentic coding sessions

Command: `{r["command"]}`

Machine: {r["machine"]}; date {r["date"]}; {r["wall_s"]} s of wall time.

AIPerf's agentic-coding trace (`traces/{r["trace"]}`:
100 sessions, 2,018 turns, contexts of 62k–200k tokens) on {r["nodes"]} simulated H100s
(Llama-3.1-8B), replayed in **closed loop**: a session's next turn is sent its recorded delay
after the previous turn ends, so faster serving moves more tokens through the same GPUs. Session
*k* starts at *k* / {r["sessions_per_s"]} s: the rate whose turns offer {r["load"]:.0%} of the
cluster's measured capacity ({r["capacity_rps"]} requests/s; AIPerf's trace starts every session
at 0). Medians of {len(next(iter(r["runs"].values())))} repetitions (from the second on, each
start moved by up to 0.4 of the spacing); every run is
in `agentic.json`. kvgate runs as live at its defaults (pending prefixes, its memory of recent
prefills, pre-warming, the fit hold); peers at their defaults and tuned on this workload
(`<peer>+tuned`: each peer's grid run on the first repetition and its point chosen as
`kvgate bench routing` chooses — among the points within 2 % of the grid's best tokens per GPU,
the lowest TTFT p99, then the highest hit rate: {_tuned_points(r)}); the best peer, of defaults
and tuned, is the one with the highest hit rate (`{r["best_peer"]["hit_rate"]}`) and the one with
the lowest TTFT p99 (`{r["best_peer"]["ttft_p99_s"]}`).

{head}
{chr(10).join(rows)}

| criterion | value | target | |
|---|---:|---|---|
{crit}

{_open_loop_prose(r)}

Saturated — AIPerf's own schedule, all 100 sessions at once, one run each — throughput is where
routing shows: kvgate / round-robin tokens per GPU {fmt(sat["tok_s_per_gpu_vs_rr"])}, per user
{fmt(sat["tok_s_per_user_vs_rr"])}:

{head}
{sat_rows}

Loaded as AIPerf loads a cluster — {conc["sessions_at_once"]} sessions at once
({r["load"]:.0%} of the trace's), a new one started as soon as one ends
(`--concurrency {conc["sessions_at_once"]}`; one run each; the peers tuned again on this
schedule: {_tuned_points(conc)}): kvgate / round-robin tokens per
GPU {fmt(conc["tok_s_per_gpu_vs_rr"])}, per user {fmt(conc["tok_s_per_user_vs_rr"])}; hit rate
against the best peer's {fmt(conc["hit_vs_best_peer"])}, TTFT p99 against the best peer's
{fmt(conc["ttft_p99_vs_best_peer"])}:

{head}
{conc_rows}

{_overflow_prose(r)}

{sweep_markdown(r.get("concurrency_sweep"))}

How much of this is the KV the contexts fight over: the same sessions at {r["load"]:.0%} load
on engines with an H200's memory ({r["larger_kv"]["kv_blocks_per_engine"]} KV blocks of 16
tokens each instead of the H100's; step times left at the H100's; capacity measured again,
{r["larger_kv"]["capacity_rps"]} requests/s; one run each):

{head}
{larger_rows}

{_pulls_markdown(r.get("with_pulls"), keys)}
`router_cpu_ms_per_request_100k` is measured live (`{r["router_cpu_command"]}`,
`longprompt.md`): a 100k-token chat request through the router's whole path.
{_live_markdown(r.get("live"))}"""


def _pulls_markdown(pulls: dict[str, Any] | None, keys: tuple[str, ...]) -> str:
    """The ``with_pulls`` runs: kvgate where engines give and take a prefix's KV."""
    if not pulls:
        return ""
    rows = "\n".join(
        f"| {name} | {fmt(p['kvgate']['pulls'])} | "
        + _cells(p["kvgate"], keys)
        + f" | {fmt(p['tok_s_per_gpu_vs_rr'])} | {fmt(p['hit_vs_best_peer'])} | "
        f"{fmt(p['ttft_p99_vs_best_peer'])} |"
        for name in ("open_loop", "at_concurrency")
        if (p := pulls.get(name))
    )
    return f"""On engines whose KV connectors give and take a prefix's KV (`docs/engines.md`,
"Pulling a prefix's KV"), a turn moved off a home with no room left for the rest of its context
loads what the home holds over the link instead of computing it again (router/decision/pull.py; the
holder answers ahead of its queue, `router.pull_priority` -1). kvgate alone changes (the others
never pull; their runs above are the comparison: the open loop's first repetition, and the
sessions-at-once runs); one run each:

| run | pulls | {" | ".join(keys)} | tok/s/GPU vs RR | hit vs best peer | p99 vs best peer |
|---|---:|{"---:|" * len(keys)}---:|---:|---:|
{rows}
"""


def _live_markdown(live: dict[str, Any] | None) -> str:
    if not live:
        return ""
    a = live["agentic"] or {}
    keys = ("hit_rate", "tok_s_per_gpu", "tok_s_per_user", "ttft_p50_s", "ttft_p99_s", "turns")
    head = "| router | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys)
    rows = "\n".join(
        f"| {p} | " + " | ".join(fmt(m.get(k)) for k in keys) + " |"
        for p, m in live["medians"].items()
    )
    met = "\n".join(
        f"* {'met' if c['met'] else '**not met**'}: {c['check']}" for c in live["checks"]
    )
    return f"""
## Live

The same sessions through the live routers (`livepeer.md`'s `agentic` workload:
`{live["command"]}`, {live["date"]}): {a.get("sessions_at_once")} at once in closed loop for
{live["duration_s"]} s on 4 simulated engines of {live["num_gpu_blocks"]} KV blocks (a few
contexts each) with a {live["prefill_tokens_per_s"]:,.0f}-token/s prefill; token counts ÷
{a.get("token_scale")}, outputs ÷ {a.get("output_scale")}, tool delays ÷ {a.get("delay_scale")};
medians of {live["repetitions"]} repetitions on fresh engines:

{head}
{rows}

{met}
"""
