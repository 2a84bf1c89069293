import json
from pathlib import Path

from analytics.sim.bench import bench_routing


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


def test_conversation_targets_compare_with_the_best_baseline_at_80_and_100() -> None:
    from analytics.sim.bench_targets import conversation_targets

    def r(policy: str, load: float, hit: float, p50: float, p99: float) -> dict[str, object]:
        return {
            "trace": "mooncake_fast25_synthetic_trace",
            "policy": policy,
            "load": load,
            "hit_rate": hit,
            "ttft_p50_s": p50,
            "ttft_p99_s": p99,
            "slo_attainment": 0.98,
        }

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
