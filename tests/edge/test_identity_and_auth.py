"""Request identity and who may call what: ids are minted by kvgate, client ids are labels, every
control endpoint needs its own credential, and a gateway sees only its own reservations."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from router.decision.hotprefix import HotPrefixes, PrewarmAdvice
from streams.topics import CONTROL
from tests.edgekit import (
    ADMIN,
    GATEWAY,
    MODEL,
    OTHER_GATEWAY,
    bearer,
    completion,
    edge,
    raw_http,
)

GW = {"X-Kvgate-Gateway-Key": GATEWAY}
OTHER = {"X-Kvgate-Gateway-Key": OTHER_GATEWAY}


async def test_one_client_request_id_cannot_share_a_reservation() -> None:
    """40 routes with one X-Request-Id: each is admitted on its own reservation or refused;
    what is reserved is exactly what the admitted requests need, within the budget."""
    async with edge(blocks=500, admission={"queue_enabled": False}) as e:
        body = completion("word " * 700, max_tokens=8)
        routed = []
        for _ in range(40):
            status, out, _ = await e.call(
                "POST", "/v1/kvgate/route", body, {**GW, "X-Request-Id": "same"}
            )
            assert status in (200, 429), out
            if status == 200:
                routed.append(out)
        ids = [r["reservation_id"] for r in routed]
        assert len(set(ids)) == len(ids) and "same" not in ids
        needed = sum(r["kv_blocks_reserved"] for r in routed)
        held_blocks, held_slots = await e.router.gate.store.held(f"default:{MODEL}")
        assert held_blocks == needed and held_slots == len(routed)
        assert 0 < needed <= 0.9 * 1000  # the red watermark of 2 × 500 blocks
        assert len(routed) < 40
        assert {d.client_request_id for d in e.decisions()} == {"same"}
        for r in routed:
            status, _, _ = await e.call(
                "POST", "/v1/kvgate/release", {"reservation_id": r["reservation_id"]}, GW
            )
            assert status == 200
        assert await e.reservations() == 0


async def test_bad_headers_are_refused_before_anything_is_reserved() -> None:
    async with edge() as e:
        port = int(e.url.rsplit(":", 1)[1])
        body = b'{"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 2}'
        for header in (
            b"X-Request-Id: abc\xff\xfe",  # not UTF-8
            b"X-Request-Id: " + b"a" * 129,  # too long
            b"X-Request-Id: has space",
            b"Idempotency-Key: \x01\x02",
            b"Authorization: Bearer sk-alpha\xff",
            b"Authorization: Token sk-alpha",
        ):
            req = (
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                + header
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            answer = await raw_http(port, req)
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.split(b" ")[1] in (b"400", b"401"), (header, answer[:200])
            if b"\x01" not in header:  # control characters: refused by the HTTP parser itself
                assert b'"error"' in payload and b'"message"' in payload, payload
        assert await e.reservations() == 0
        assert {d.admission_reason for d in e.decisions()} <= {"bad_header", "unauthorized"}
        assert all(d.chosen_node is None for d in e.decisions())


async def test_gateway_api_needs_a_gateway_key_and_owns_its_reservations() -> None:
    async with edge() as e:
        body = completion()
        for headers in ({}, bearer("sk-alpha"), bearer(ADMIN), {"X-Kvgate-Gateway-Key": "no"}):
            status, out, _ = await e.call("POST", "/v1/kvgate/route", body, headers)
            assert status == 401 and out["error"]["type"] == "unauthorized", (headers, out)
        assert await e.reservations() == 0
        status, routed, _ = await e.call("POST", "/v1/kvgate/route", body, GW)
        assert status == 200
        rid = routed["reservation_id"]
        # another gateway, or nobody: the reservation stays where it is
        for headers, want in ((OTHER, 404), ({}, 401), (bearer("sk-alpha"), 401)):
            for path in ("/v1/kvgate/renew", "/v1/kvgate/release"):
                status, out, _ = await e.call("POST", path, {"reservation_id": rid}, headers)
                assert status == want, (path, headers, out)
        assert await e.reservations() == 1
        status, _, _ = await e.call("POST", "/v1/kvgate/renew", {"reservation_id": rid}, GW)
        assert status == 200
        status, _, _ = await e.call("POST", "/v1/kvgate/release", {"reservation_id": rid}, GW)
        assert status == 200
        assert await e.reservations() == 0


async def test_gateway_api_is_closed_without_gateway_keys() -> None:
    async with edge(router={"gateway_keys": {}}) as e:
        status, out, _ = await e.call("POST", "/v1/kvgate/route", completion(), GW)
        assert status == 403 and "gateway_keys" in out["error"]["message"]


async def test_admin_endpoints_need_an_admin_key_or_the_loopback_listener() -> None:
    async with edge() as e:
        for headers in ({}, bearer("sk-alpha"), GW, bearer("wrong")):
            status, _, _ = await e.call("GET", "/v1/kvgate/state", headers=headers)
            assert status == 401
            status, _, _ = await e.call("POST", "/v1/kvgate/decide", completion(), headers)
            assert status == 401
        status, state, _ = await e.call("GET", "/v1/kvgate/state", headers=bearer(ADMIN))
        assert status == 200 and set(state["nodes"]) == {"n1", "n2"}
        assert e.admin_url is not None and "127.0.0.1" in e.admin_url
        status, state, _ = await e.call("GET", "/v1/kvgate/state", base=e.admin_url)
        assert status == 200
        status, d, _ = await e.call("POST", "/v1/kvgate/decide", completion(), base=e.admin_url)
        assert status == 200 and d["chosen_node"] in ("n1", "n2")
        # the admin listener serves no traffic
        status, _, _ = await e.call("POST", "/v1/completions", completion(), base=e.admin_url)
        assert status == 404


async def test_decide_is_a_dry_run() -> None:
    """/decide records nothing, reserves nothing and publishes no pre-warm advice, even when
    the same request routed for real would."""
    async with edge() as e:
        calls: list[Any] = []
        assert e.router.director.rules.hot is not None

        def always_hot(
            now: float, hashes: Any, matches: Any, nodes: Any, advise: bool = True
        ) -> PrewarmAdvice:
            assert advise  # router.prewarm is on
            calls.append(now)
            return PrewarmAdvice(hashes[-1], len(hashes), 0.9, ("n1",), ("n2",))

        class Spy(HotPrefixes):
            def observe(self, *args: Any) -> PrewarmAdvice | None:
                return always_hot(*args)

        d = e.router.director
        d.rules = replace(d.rules, hot=Spy())
        for _ in range(3):
            status, _, _ = await e.call("POST", "/v1/kvgate/decide", completion(), bearer(ADMIN))
            assert status == 200
        assert calls == [] and e.published(CONTROL.suffix) == [] and e.decisions() == []
        assert await e.reservations() == 0
        status, _, _ = await e.call("POST", "/v1/completions", completion())
        assert status == 200
        assert len(calls) == 1 and len(e.published(CONTROL.suffix)) == 1
        advice = e.published(CONTROL.suffix)[0]
        assert b"hello" not in advice  # token ids and hashes, never the prompt text
        control = [(k, v) for t, k, v in e.router.bus._outbox if t.endswith(".control")]
        assert [v is None for _, v in control] == [False, True]  # then its tombstone
        assert control[0][0] == control[1][0]


async def test_minted_request_id_is_returned_and_the_label_recorded() -> None:
    async with edge() as e:
        status, _, headers = await e.call(
            "POST", "/v1/completions", completion(), {"X-Request-Id": "client-42"}
        )
        assert status == 200
        minted = headers["X-Request-Id"]
        assert minted != "client-42" and len(minted) == 32
        (d,) = e.decisions()
        assert d.request_id == minted and d.client_request_id == "client-42"
        assert d.model == MODEL


async def test_refusals_before_admission_are_recorded_within_a_rate() -> None:
    async with edge(admission={"require_api_key": True}, router={"refusal_records_per_s": 5}) as e:
        status, _, _ = await e.call("POST", "/v1/completions", completion(), {"X-Request-Id": "a"})
        assert status == 401
        status, _, _ = await e.call(
            "POST", "/v1/completions", completion(model="nope"), bearer("sk-alpha")
        )
        assert status == 404
        status, _, _ = await e.call("POST", "/v1/completions", data=b"{", headers=bearer("sk-beta"))
        assert status == 400
        got = {(d.admission_reason, d.tenant, d.model, d.client_request_id) for d in e.decisions()}
        assert got == {
            ("unauthorized", "unauthenticated", "", "a"),
            ("unknown_model", "alpha", "nope", None),
            ("bad_json", "beta", "", None),
        }
        assert all(d.admission == "rejected" and d.chosen_node is None for d in e.decisions())
        for _ in range(50):  # a flood: recorded up to the rate, counted beyond it
            await e.call("POST", "/v1/completions", completion())
        assert len(e.decisions()) < 20
        metrics = (await e.call("GET", "/metrics"))[1]
        assert "kvgate_router_refusals_unrecorded_total" in metrics


async def test_an_anonymous_client_storming_new_requests_is_refused_before_admission() -> None:
    """Refused once, a client that keeps sending new prompts before its Retry-After gets a
    burst through to admission, then ``retry_storm`` refusals (no reservation touched)."""
    async with edge(
        blocks=200, admission={"queue_enabled": False, "retry_guard_client_burst": 2}
    ) as e:
        reasons = []
        for i in range(6):  # a new prompt each time: not retries of one attempt
            big = completion(f"question {i} " + "word " * 700, max_tokens=6000, ignore_eos=True)
            status, out, headers = await e.call("POST", "/v1/kvgate/route", big, GW)
            assert status == 429, out
            assert "Retry-After" in headers
            reasons.append(out["error"]["kvgate_reason"])
        assert reasons[0] != "retry_storm"  # refused by the budget: now backing off is due
        assert reasons[1:3] == [reasons[0]] * 2  # a burst of new requests still reaches it
        assert reasons[3:] == ["retry_storm"] * 3
        # a tenant with an API key has many users: its quotas bound it, not this guard
        for i in range(6):
            big = completion(f"keyed {i} " + "word " * 700, max_tokens=6000, ignore_eos=True)
            status, out, _ = await e.call(
                "POST", "/v1/kvgate/route", big, {**GW, **bearer("sk-alpha")}
            )
            assert status == 429 and out["error"]["kvgate_reason"] != "retry_storm", out
