"""The proxy benchmark's report (:mod:`tests.benchmarks.proxy`): the headline figures and the
issue's targets from the measured targets, and ``proxy.md``."""

from __future__ import annotations

from typing import Any

__all__ = ["ACHIEVED", "CLIENT_LAG_MS", "render", "summarize"]

ACHIEVED = 0.95  # of the offered rate, for a rate to count as sustained
CLIENT_LAG_MS = 50.0  # the client sent later than this (p99): the point measured the client


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures: kvgate's best worker count and the targets of the issue."""
    t = result["targets"]
    kv_names = [n for n in t if n.startswith("kvgate-w")]
    best_kv = max(kv_names, key=lambda n: t[n]["max_rps"]) if kv_names else None
    kv = t[best_kv] if best_kv else {"max_rps": 0.0}
    half = kv.get("at_half_rate") or {}
    sglang, bare = t.get("sglang", {}).get("max_rps", 0.0), t.get("bare", {}).get("max_rps", 0.0)
    sgl_half = t.get("sglang", {}).get("at_half_rate") or {}
    added_p50 = half.get("added_ttft_p50_ms")
    sgl_p50 = sgl_half.get("added_ttft_p50_ms")
    cpu, sgl_cpu = half.get("cpu_ms_per_request"), sgl_half.get("cpu_ms_per_request")

    def half_cpu(name: str) -> float | None:
        cpu: float | None = (t.get(name, {}).get("at_half_rate") or {}).get("cpu_ms_per_request")
        return cpu

    # the picker at its default (kvgate's HTTP/2) and on grpcio, each beside its bare floor
    epp_cpu, bare_native_cpu = half_cpu("kvgate-epp"), half_cpu("bare-epp-native")
    grpcio_cpu, bare_epp_cpu = half_cpu("kvgate-epp-grpcio"), half_cpu("bare-epp")
    return {
        "kvgate_max_rps": kv["max_rps"],
        "sglang_max_rps": sglang,
        "bare_max_rps": bare,
        "direct_max_rps": t.get("direct", {}).get("max_rps", 0.0),
        "workers": int(best_kv.removeprefix("kvgate-w")) if best_kv else None,
        "kvgate_cpu_ms_per_request": cpu,
        "sglang_cpu_ms_per_request": sgl_cpu,
        "added_ttft_p50_ms": added_p50,
        "added_ttft_p99_ms": half.get("added_ttft_p99_ms"),
        "sglang_added_ttft_p50_ms": sgl_p50,
        "epp_transport": "native",
        "epp_cpu_ms_per_request": epp_cpu,
        "epp_max_rps": t.get("kvgate-epp", {}).get("max_rps"),
        "bare_epp_native_cpu_ms_per_request": bare_native_cpu,
        "epp_over_bare_epp_cpu": round(epp_cpu / bare_native_cpu, 2)
        if epp_cpu is not None and bare_native_cpu
        else None,
        # the picker on grpcio's server (router.epp_transport: grpcio), and that floor
        "epp_grpcio_cpu_ms_per_request": grpcio_cpu,
        "epp_grpcio_max_rps": t.get("kvgate-epp-grpcio", {}).get("max_rps"),
        "bare_epp_cpu_ms_per_request": bare_epp_cpu,
        "targets_met": {
            "kvgate_cpu_le_1.5ms_and_1.6x_sglang": cpu is not None
            and sgl_cpu is not None
            and cpu <= 1.5
            and cpu <= 1.6 * sgl_cpu,
            "kvgate_vs_sglang": sglang > 0 and kv["max_rps"] >= sglang,
            "epp_cpu_le_1ms": epp_cpu is not None and epp_cpu <= 1.0,
            "added_p50_le_sglang": added_p50 is not None
            and sgl_p50 is not None
            and added_p50 <= sgl_p50,
        },
        **result,
    }


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:+.2f}"


def _cpu(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def render(report: dict[str, Any]) -> str:
    rows, ramps = [], []
    for name, t in report["targets"].items():
        half = t.get("at_half_rate") or {}
        cpu = half.get("cpu_ms_per_request")
        rows.append(
            f"| {name} | {t['max_rps']:.0f} | {half.get('rate_rps', 0):.0f} | "
            f"{_ms(half.get('added_ttft_p50_ms'))} | {_ms(half.get('added_ttft_p99_ms'))} | "
            f"{'—' if cpu is None else f'{cpu:.2f}'} | {t.get('rss_mb', 0):.0f} | "
            f"{(half.get('target') or {}).get('errors', '—')} |"
        )
        for p in t["points"]:
            ramps.append(
                f"| {name} | {p['offered_rps']:.0f} | {p['achieved_rps']:.0f} | {p['errors']} | "
                f"{p['ttft_p50_ms']:.1f} / {p['ttft_p99_ms']:.1f} | {p['client_lag_p99_ms']:.0f} "
                f"| {'yes' if p['sustained'] else 'no'} |"
            )
    met = report["targets_met"]
    yes = {True: "met", False: "not met"}
    return f"""# Proxy throughput: kvgate's router, sglang-router and a bare proxy

Command: `{report["command"]}`

Machine: {report["machine"]}; date {report["date"]}; sglang-router
{report["sglang_router_version"]} (`cache_aware`); {report["engines"]} simulated engines. Poisson
arrivals of short streamed completions (4 tokens) at rising rates, {report["duration_s_per_point"]}
s per point; a rate is sustained when nothing failed and the requests completed at
≥ {ACHIEVED:.0%} of the rate they were sent at. The
added TTFT is measured at half of each target's max rate against the engines reached directly at
the same rate. Everything shares the machine's 2 cores (the engines, Kafka, Redis, the worker, the
proxies and the client): compare within this run.

* **kvgate** (admission + routing + recording, the full path; `--workers` tried:
  {", ".join(n.removeprefix("kvgate-w") for n in report["targets"] if n[:8] == "kvgate-w")};
  best: {report["workers"]}): **{report["kvgate_max_rps"]:.0f} req/s**; sglang-router
  **{report["sglang_max_rps"]:.0f}**; bare proxy **{report["bare_max_rps"]:.0f}**; engines direct
  **{report["direct_max_rps"]:.0f}**.
* CPU per request at half the max rate: kvgate **{_cpu(report["kvgate_cpu_ms_per_request"])} ms**,
  sglang-router **{_cpu(report["sglang_cpu_ms_per_request"])} ms** (≤ 1.5 ms and ≤ 1.6 ×
  sglang-router's: **{yes[met["kvgate_cpu_le_1.5ms_and_1.6x_sglang"]]}**).
* kvgate's max rate ≥ sglang-router's: **{yes[met["kvgate_vs_sglang"]]}**; added TTFT p50 ≤
  sglang-router's: **{yes[met["added_p50_le_sglang"]]}** (kvgate {_ms(report["added_ttft_p50_ms"])}
  ms p50, {_ms(report["added_ttft_p99_ms"])} ms p99; sglang-router
  {_ms(report["sglang_added_ttft_p50_ms"])} ms p50).
* Through the endpoint picker (`kvgate-epp`: Envoy's ext_proc exchange driven by a client built
  from Envoy's protos, the request then sent to the picked engine directly, its answer streamed
  back through the exchange), on its default server (`router.epp_transport: native`, kvgate's own
  HTTP/2): kvgate's CPU per request **{_cpu(report.get("epp_cpu_ms_per_request"))} ms** (≤ 1.0
  ms: **{yes[met.get("epp_cpu_le_1ms", False)]}**); its max rate measures the Python client,
  which does Envoy's share too. The floor of a picker on that server (`bare-epp-native`,
  `tests/benchmarks/bareepp.py --native`: every message answered and nothing else done, measured
  at the rate kvgate's picker was): **{_cpu(report.get("bare_epp_native_cpu_ms_per_request"))}
  ms** per request; kvgate's picker costs **{report.get("epp_over_bare_epp_cpu") or "—"}×** that.
* The same picker on grpcio's asyncio server (`kvgate-epp-grpcio`, `router.epp_transport:
  grpcio`): **{_cpu(report.get("epp_grpcio_cpu_ms_per_request"))} ms** per request; the bare
  picker on grpcio (`bare-epp`): **{_cpu(report.get("bare_epp_cpu_ms_per_request"))} ms**.

{TABLE_HEADER}
{chr(10).join(rows)}

A max rate at the last point below the ramp's ceiling (`--ceiling`, 3000 req/s) is a lower bound:
the target was not driven harder.

CPU ms / request: user + system time of the target's processes (kvgate: the supervisor and its
workers) over the half-rate run, per request — what the proxy itself costs, independent of the
competition for the cores. RSS: the same processes' resident memory at the end of the ramp.

## Every point of the ramps

{RAMP_HEADER}
{chr(10).join(ramps)}

A client lag above {CLIENT_LAG_MS:.0f} ms means the load generator itself fell behind its schedule
at that point (it shares the cores too).
"""


TABLE_HEADER = (
    "| target | max req/s | half rate | added TTFT p50 ms | added p99 ms | CPU ms / request "
    "| RSS MiB | errors at half |\n|---|---:|---:|---:|---:|---:|---:|---:|"
)
RAMP_HEADER = (
    "| target | offered req/s | achieved req/s | errors | TTFT p50 / p99 ms "
    "| client lag p99 ms | sustained |\n|---|---:|---:|---:|---:|---:|---|"
)
