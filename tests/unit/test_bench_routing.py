import json
from pathlib import Path
from typing import Any

import pytest

from analytics.sim.bench import bench_routing, reuse


def test_bench_writes_every_number_and_the_targets(tmp_path: Path) -> None:
    report = bench_routing(
        [("shared_prompt", 300)],
        nodes=4,
        loads=[0.8],
        out_dir=tmp_path,
        command="kvgate bench routing --requests 300",
        policies=["round_robin", "least_requests", "kvgate"],
        jobs=1,
    )
    saved = json.loads((tmp_path / "routing.json").read_text())
    assert saved == report
    assert {r["policy"] for r in saved["results"]} == {"round_robin", "least_requests", "kvgate"}
    speed = saved["sim_requests_per_min_alone"]["shared_prompt"]
    assert len(speed["runs"]) == 3 and speed["runs"][0] <= speed["median"] <= speed["best"]
    names = [t["target"] for t in saved["targets"]]
    assert any(n.startswith("P99 TTFT <= 0.5x round-robin") for n in names)
    assert any(n.startswith("simulator:") for n in names)
    md = (tmp_path / "routing.md").read_text()
    assert "## Simulator speed" in md and "| shared_prompt |" in md
    assert (tmp_path / "routing_ttft_p99_s.png").exists()
    floor = saved["bounds"]["shared_prompt"]["0.8"]
    assert 0 < floor["ttft_floor_p50_s"] <= floor["ttft_floor_p99_s"]
    kvgate = next(r for r in saved["results"] if r["policy"] == "kvgate")
    assert floor["ttft_floor_p99_s"] <= kvgate["ttft_p99_s"]
    assert "TTFT floor p50" in md
    cold = saved["cold_start"]  # every policy's first minute, and kvgate's without the probe
    assert {(r["policy"], r["load"]) for r in cold["results"]} == {
        (p, load)
        for p in ("round_robin", "least_requests", "kvgate", "kvgate, no probe")
        for load in cold["loads"]
    }
    assert "## Cold start" in md and "| kvgate, no probe |" in md

    # the targets again from the saved runs, without simulating
    source = [("shared_prompt", 300)]
    again = reuse(source, tmp_path, "kvgate bench routing --reuse", jobs=1)
    assert again["targets"] == report["targets"] and again["bounds"] == report["bounds"]
    assert again["results"] == report["results"]

    def cold(r: dict[str, Any]) -> dict[tuple[str, float], dict[str, Any]]:
        wall = ("sim_wall_s", "sim_requests_per_min")  # the machine's, not the simulation's
        return {
            (x["policy"], x["load"]): {k: v for k, v in x.items() if k not in wall}
            for x in r["cold_start"]["results"]
        }

    assert cold(again) == cold(report)  # every policy's cold start again, the same
    assert again["reused"]["command"] == "kvgate bench routing --reuse"
    assert "no run again" in (tmp_path / "routing.md").read_text()

    # one policy again (a change to it): its rows are replaced, the others' kept
    saved = json.loads((tmp_path / "routing.json").read_text())
    for r in saved["results"]:
        if r["policy"] == "kvgate":
            r["hit_rate"] = -1.0  # stands for a stale number
    (tmp_path / "routing.json").write_text(json.dumps(saved))
    cmd = "kvgate bench routing --reuse --policies kvgate"
    fresh = reuse(source, tmp_path, cmd, ["kvgate"], jobs=1)
    rows = {r["policy"]: r for r in fresh["results"]}
    assert len(fresh["results"]) == 3 and rows["kvgate"]["hit_rate"] == kvgate["hit_rate"]
    assert rows["round_robin"] == next(r for r in report["results"] if r["policy"] == "round_robin")
    assert fresh["reused"]["rerun"] == ["kvgate"]
    assert "kvgate ran again" in (tmp_path / "routing.md").read_text()
    with pytest.raises(ValueError, match="tuned peers"):
        reuse(source, tmp_path, cmd, ["llmd_weighted"], jobs=1)


MOONCAKE = "mooncake_fast25_synthetic_trace"


def run(
    policy: str, load: float, hit: float, p50: float, p99: float, goodput: float = 10.0
) -> dict[str, object]:
    """One simulated run's figures as the targets read them (a Mooncake run)."""
    return {
        "trace": MOONCAKE,
        "policy": policy,
        "load": load,
        "hit_rate": hit,
        "ttft_p50_s": p50,
        "ttft_p99_s": p99,
        "slo_attainment": 0.98,
        "goodput_rps": goodput,
    }


def test_conversation_targets_compare_with_the_best_baseline_at_80_and_100() -> None:
    from analytics.sim.bench_targets import conversation_targets

    r = run

    results = [
        r("kvgate", 0.8, 0.50, 0.10, 1.0),
        r("dynamo_cost", 0.8, 0.45, 0.30, 2.0),
        r("llmd_weighted+tuned", 0.8, 0.52, 0.25, 1.1),
        r("kvgate", 1.0, 0.49, 0.20, 2.0),
        r("dynamo_cost", 1.0, 0.40, 0.50, 3.0),
        r("seed_score", 1.0, 0.99, 0.01, 0.01),  # kvgate's own: not a baseline
    ]
    rows = {(t["target"], t["trace"]): t for t in conversation_targets(results)}
    hit80 = rows[
        ("conversations: hit rate >= the best baseline's at 80% load", results[0]["trace"])
    ]
    assert hit80["reference"].startswith("llmd_weighted+tuned") and not hit80["met"]
    p99 = rows[
        ("conversations: P99 TTFT <= 0.85x the best baseline at 80% load", results[0]["trace"])
    ]
    assert p99["ratio"] == round(1.0 / 1.1, 3) and not p99["met"]
    p50 = rows[
        ("conversations: P50 TTFT <= 0.5x the best baseline at 100% load", results[0]["trace"])
    ]
    assert p50["met"] and p50["ratio"] == 0.4
    slo = rows[("conversations: SLO attainment >= 97.5 % at 100% load", results[0]["trace"])]
    assert slo["met"]
    assert len(rows) == 2 + 4  # 80 %: hit, p99; 100 %: hit, p99, p50, SLO
    assert all("feasible" not in t for t in rows.values())  # no bounds given


def test_conversation_targets_say_what_is_within_reach_and_who_serves_the_load() -> None:
    from analytics.sim.bench_targets import conversation_targets

    trace = MOONCAKE

    def r(policy: str, load: float, hit: float, p99: float, goodput: float) -> dict[str, object]:
        return run(policy, load, hit, p99 / 10, p99, goodput)

    results = [
        r("kvgate", 0.8, 0.50, 1.0, 10.0),
        r("llmd_weighted+tuned", 0.8, 0.52, 1.1, 9.5),
        r("vllm_prefix_aware", 0.8, 0.60, 90.0, 0.5),  # everything on one node
        r("kvgate", 1.0, 0.49, 2.0, 12.0),
        r("llmd_weighted", 1.0, 0.40, 3.0, 12.0),
    ]
    bounds = {
        trace: {
            "0.8": {"ttft_floor_p50_s": 0.01, "ttft_floor_p99_s": 0.9, "slo_bound": 0.99},
            "1.0": {"ttft_floor_p50_s": 0.2, "ttft_floor_p99_s": 0.9, "slo_bound": 0.96},
        }
    }
    rows = {t["target"]: t for t in conversation_targets(results, bounds)}
    hit = rows["conversations: hit rate >= the best baseline's at 80% load"]
    assert hit["reference"] == "vllm_prefix_aware 0.600 (goodput 0.05× kvgate's)"
    serving = rows[
        "conversations: hit rate >= the best baseline's that serves the load "
        "(goodput >= 0.9x kvgate's) at 80% load"
    ]
    assert serving["reference"] == "llmd_weighted+tuned 0.520" and not serving["met"]
    # 100 %: the best hit rate serves the load, no second row
    assert not any("serves the load" in t and "100%" in t for t in rows)
    p99 = rows["conversations: P99 TTFT <= 0.85x the best baseline at 80% load"]
    assert p99["feasible"] and p99["bound"] == "floor 0.900 s"  # 0.9 <= 0.85 × 1.1
    p50 = rows["conversations: P50 TTFT <= 0.5x the best baseline at 100% load"]
    assert not p50["feasible"]  # floor 0.2 > 0.5 × 0.3
    slo = rows["conversations: SLO attainment >= 97.5 % at 100% load"]
    assert not slo["feasible"] and slo["bound"] == "SLO bound 0.960"
