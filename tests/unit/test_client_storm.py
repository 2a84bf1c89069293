"""The retry-storm guard across new requests: a refused client that keeps sending new requests
(new keys, new prompts) before its Retry-After gets a burst through to admission, then is refused
without reaching it; anonymous clients are held to account by address, not as one identity."""

from __future__ import annotations

import asyncio

from admission.core import Rejection, RejectReason
from admission.settings import Tenant
from admission.storm import InProcessStormStore, StormGuard
from router.flow.headers import forwarded_peer
from router.flow.intake import client_identity

ANON = Tenant(name="anonymous")


def test_new_requests_during_retry_after_are_a_storm_beyond_the_burst() -> None:
    async def run() -> None:
        clock = [100.0]
        guard = StormGuard(InProcessStormStore(clock=lambda: clock[0]), 60.0, 600.0, 3)
        refusal = Rejection(RejectReason.RED_WATERMARK, True, 10.0, "full")
        await guard.refused("a1", refusal, 100.0, "tenant-x")
        verdicts = [await guard.check_client("tenant-x", 101.0) for _ in range(5)]
        assert verdicts[:3] == [None, None, None]  # a burst of others' requests still passes
        storm = verdicts[3]
        assert storm is not None and storm.reason == RejectReason.RETRY_STORM
        assert storm.retry_after_s == 9.0  # the time left, not an escalated penalty
        assert await guard.check_client("tenant-y", 101.0) is None  # other clients unaffected
        clock[0] = 111.0
        assert await guard.check_client("tenant-x", 111.0) is None  # Retry-After passed
        # a retry-storm refusal does not extend the client's own Retry-After
        await guard.refused("a2", storm, 101.0, "tenant-x")
        assert await guard.store.not_before("client|tenant-x") == 110.0
        # a refusal with no Retry-After (e.g. too large) says nothing about backing off
        await guard.refused("a3", Rejection(RejectReason.TOO_LARGE, False, None, ""), 111.0, "z")
        assert await guard.store.not_before("client|z") is None

    asyncio.run(run())


def test_anonymous_clients_are_known_by_address() -> None:
    gold = Tenant(name="gold")
    assert client_identity(gold, ANON, "10.0.0.1") == "gold"  # a key is the identity
    assert client_identity(ANON, ANON, "10.0.0.1") == "anonymous@10.0.0.1"
    assert client_identity(ANON, ANON, "10.0.0.2") != client_identity(ANON, ANON, "10.0.0.1")
    assert client_identity(ANON, ANON, None) == "anonymous"


def test_the_gateway_appended_address_is_the_peer() -> None:
    assert forwarded_peer({"x-forwarded-for": "1.2.3.4, 10.0.0.7"}) == "10.0.0.7"
    assert forwarded_peer({"x-forwarded-for": "2001:db8::1"}) == "2001:db8::1"
    assert forwarded_peer({"x-forwarded-for": "10.0.0.7, evil\r\nX: y"}) is None
    assert forwarded_peer({}) is None


async def combined_equals_separate(joined: StormGuard, separate: StormGuard, now: float) -> None:
    """check_request on one guard answers what check then check_client answer on another in the
    same state, for attempts and clients with and without a running Retry-After (the shared body
    of the store tests)."""
    refusal = Rejection(RejectReason.RED_WATERMARK, True, 10.0, "full")
    for guard in (joined, separate):
        await guard.refused("told", refusal, now, "busy")
    for client, attempt, new in [
        ("busy", "told", True),  # the attempt itself, early
        ("busy", "other", True),  # a new request of a client told to wait
        ("busy", "another", False),  # ... whose new requests are not guarded
        ("calm", "fresh", True),  # neither
    ]:
        for i in range(6):  # past the burst: strikes count the same either way
            one = await joined.check_request(client, attempt, now + 1 + i, new)
            two = await separate.check(client, attempt, now + 1 + i)
            if two is None and new:
                two = await separate.check_client(client, now + 1 + i)
            assert (one is None) == (two is None), (client, attempt, new, i)
            if one is not None and two is not None:
                assert one.reason == two.reason == RejectReason.RETRY_STORM
                assert one.retry_after_s == two.retry_after_s


def test_one_read_for_attempt_and_client_answers_as_two() -> None:
    def guard() -> StormGuard:
        return StormGuard(InProcessStormStore(), 60.0, 600.0, 3)

    asyncio.run(combined_equals_separate(guard(), guard(), 100.0))
