"""A tenant with a rate gets 429 ``rate_limited`` with the wait until its window has room as
``Retry-After`` once it is over it, through the router's HTTP route; the refusal is recorded;
its other requests and other tenants are untouched."""

from __future__ import annotations

from admission.settings import Tenant
from tests.edgekit import TENANTS, bearer, completion, edge


async def test_over_its_requests_per_minute_a_tenant_is_told_when_to_come_back() -> None:
    metered = {
        **TENANTS,
        "sk-metered": Tenant(name="metered", requests_per_minute=3),
    }
    async with edge(admission={"tenants": metered}) as e:
        for _ in range(3):
            status, body, _ = await e.call(
                "POST", "/v1/completions", completion(), bearer("sk-metered")
            )
            assert status == 200, body
        status, body, headers = await e.call(
            "POST", "/v1/completions", completion(), bearer("sk-metered")
        )
        assert status == 429 and body["error"]["type"] == "rate_limited", body
        assert 55 <= int(headers["Retry-After"]) <= 60  # the first leaves the minute's window
        status, _, _ = await e.call("POST", "/v1/completions", completion(), bearer("sk-alpha"))
        assert status == 200  # other tenants are not held to it
        refused = e.decisions()[-2]
        assert (refused.tenant, refused.admission, refused.admission_reason) == (
            "metered",
            "rejected",
            "rate_limited",
        )
