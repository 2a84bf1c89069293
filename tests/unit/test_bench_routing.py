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
