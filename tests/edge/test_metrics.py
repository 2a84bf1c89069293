"""The router's Prometheus metrics show its health on their own: request latencies and tokens
per model, in-flight requests and queue depth per priority, the KV budget in use, and decision
time without the time queued; label values stay bounded."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from router.metrics import BoundedLabels
from tests.edgekit import MODEL, bearer, completion, edge


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_latencies_tokens_and_load_per_model_and_priority() -> None:
    async with edge() as e:
        for i in range(3):
            status, body, _ = await e.call(
                "POST", "/v1/completions", completion(f"request {i} " * 30), bearer("sk-alpha")
            )
            assert status == 200, body
        stream = completion("a streamed one " * 30, stream=True)
        status, _, _ = await e.call("POST", "/v1/completions", stream, bearer("sk-beta"))
        assert status == 200
        status, text, _ = await e.call("GET", "/metrics")
        assert status == 200
        s = _samples(text)
        m = (("model", MODEL),)
        assert s[("kvgate_router_ttft_seconds_count", m)] == 4
        assert s[("kvgate_router_tpot_seconds_count", m)] == 4  # max_tokens 4: > 1 token
        done = (("model", MODEL), ("status", "ok"))
        assert s[("kvgate_router_request_duration_seconds_count", done)] == 4
        assert s[("kvgate_router_tokens_total", (("kind", "generated"), *m))] == 16
        assert s[("kvgate_router_tokens_total", (("kind", "prompt"), *m))] > 4 * 30
        assert s[("kvgate_router_decision_seconds_count", ())] == 4
        for priority in ("high", "normal", "low"):
            assert s[("kvgate_router_inflight_requests", (("priority", priority),))] == 0
            assert s[("kvgate_router_admission_queue_depth", (("priority", priority),))] == 0
        assert ("kvgate_router_kv_budget_used_ratio", (("pool", f"default:{MODEL}"),)) in s


def test_label_values_are_bounded() -> None:
    labels = BoundedLabels(2)
    assert [labels.get(m) for m in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]
