"""The worker's /metrics page reads as Prometheus text to prometheus_client's own parser: every
family, the commit phases as a summary (sum and count) and their last values."""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from streams.workermetrics import render_metrics


def test_the_page_parses_and_says_what_the_worker_did() -> None:
    folded = Counter(heartbeats=7, kv_events=30, dead_lettered=2, recovery_reread=1)
    text = render_metrics(
        folded,
        Counter(prefix_index=4, load=3),
        nodes=3,
        entries=120,
        commit_seconds={"write": [0.5, 10, 0.04], "send": [1.0, 10, 0.12]},
        lag=Counter(kv_events=9),
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("kvgate_worker_folded_total", (("source", "kv_events"),))] == 30
    assert samples[("kvgate_worker_folded_total", (("source", "ledger"),))] == 0
    assert samples[("kvgate_worker_dead_lettered_total", ())] == 2
    assert samples[("kvgate_worker_recovery_rereads_total", ())] == 1
    assert samples[("kvgate_worker_index_entries", ())] == 120
    assert samples[("kvgate_worker_commit_seconds_sum", (("phase", "send"),))] == 1.0
    assert samples[("kvgate_worker_commit_seconds_count", (("phase", "write"),))] == 10
    assert samples[("kvgate_worker_commit_seconds_count", (("phase", "commit"),))] == 0
    assert samples[("kvgate_worker_last_commit_seconds", (("phase", "send"),))] == 0.12
    assert samples[("kvgate_worker_consumer_lag", (("source", "kv_events"),))] == 9
