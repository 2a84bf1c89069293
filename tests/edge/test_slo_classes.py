"""SLO classes on a live router: a header may pick only an allowed class (else 400), a request
whose class's TTFT its best node cannot meet is refused at once with Retry-After, and the
router's metrics count met, missed and refused requests per class."""

from __future__ import annotations

from admission.settings import DEFAULT_SLO_CLASSES, SloClass, Tenant
from tests.edgekit import bearer, completion, edge

TENANTS = {
    "sk-alpha": Tenant(name="alpha"),
    "sk-rush": Tenant(name="rush", priority="high", slo_class="instant"),
}
CLASSES = {
    **DEFAULT_SLO_CLASSES,
    # no node can start anything in a microsecond: every request of this class is late
    "instant": SloClass(ttft_s=1e-6, tpot_s=1.0, priority="high"),
}


async def test_slo_class_header_deadline_refusal_and_metrics() -> None:
    async with edge(admission={"tenants": TENANTS, "slo_classes": CLASSES}) as e:
        status, body, _ = await e.call(
            "POST", "/v1/completions", completion(), {"X-Kvgate-Slo-Class": "interactive"}
        )
        assert status == 400 and "not available" in body["error"]["message"]
        status, body, _ = await e.call(
            "POST",
            "/v1/completions",
            completion(),
            {**bearer("sk-alpha"), "X-Kvgate-Slo-Class": "standard"},
        )
        assert status == 200, body
        status, body, headers = await e.call(
            "POST", "/v1/completions", completion(), bearer("sk-rush")
        )
        assert status == 429 and body["error"]["kvgate_reason"] == "deadline"
        assert int(headers["Retry-After"]) >= 1
        # nothing is left reserved by the refused request
        assert not e.router.gate.held
        _, text, _ = await e.call("GET", "/metrics")
        assert 'kvgate_router_slo_requests_total{outcome="met",slo_class="standard"} 1.0' in text
        assert 'kvgate_router_slo_requests_total{outcome="refused",slo_class="instant"} 1.0' in text
        assert 'kvgate_router_rejections_total{reason="deadline"} 1.0' in text
        decisions = e.decisions()
        assert [d.priority for d in decisions][-2:] == ["normal", "high"]
