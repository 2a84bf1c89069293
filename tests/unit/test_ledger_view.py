"""``InflightLedger.view``: the decision's per-node loop reuses a node's view while nothing it
reads has moved, and is never stale — after any sequence of dispatches, first tokens,
finishes, heartbeats, learned and reported prefill rates and time, it says what
``router_state`` says (the decode backlog in whole blocks of 16 tokens)."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from router.decision.inflight import DECODE_GRAIN, InflightLedger
from tests.factories import node_view

NODES = ("a", "b", "c")


def _expected(led: InflightLedger, v, hb: float, now: float, reported: float):  # type: ignore[no-untyped-def]
    pending, backlog, remaining, long_blocks, rate = led.router_state(
        v.node_id, hb, now, "m", reported
    )
    return (pending, backlog, remaining - remaining % DECODE_GRAIN, long_blocks, rate)


def _seen(v):  # type: ignore[no-untyped-def]
    return (
        v.pending,
        v.prefill_backlog_tokens,
        v.decode_backlog_tokens,
        v.long_kv_blocks,
        v.prefill_tokens_per_s,
    )


def test_the_same_view_comes_back_while_nothing_moved() -> None:
    led = InflightLedger()
    v = node_view("a", used=10, running=1, waiting=0, kv_blocks_total=100, heartbeat_ts=1.0)
    led.dispatch("r1", "a", 1.5, 3000, expected_output=200)
    first = led.view(v, 1.0, 2.0, "m")
    assert first is not v and first.pending == 1 and first.prefill_backlog_tokens == 3000
    assert led.view(v, 1.0, 2.0, "m") is first  # nothing moved
    led.first_token("r1", 2.5)
    after = led.view(v, 1.0, 2.6, "m")
    assert after is not first and after.prefill_backlog_tokens == 0
    assert led.view(v, 1.0, 2.6, "m") is after
    # time moves the decode backlog: a new view once it crosses a block, not before
    same = led.view(v, 1.0, 2.6 + 0.2 * 0.03 * DECODE_GRAIN / 16, "m")
    later = led.view(v, 1.0, 2.6 + 2 * 0.03 * DECODE_GRAIN, "m")
    assert later.decode_backlog_tokens < after.decode_backlog_tokens
    assert same is after or same.decode_backlog_tokens == after.decode_backlog_tokens
    beat = replace(v, heartbeat_ts=3.0)  # a new heartbeat: the pending dispatch is in it
    assert led.view(beat, 3.0, 3.0, "m").pending == 0


ops = st.lists(
    st.tuples(
        st.sampled_from(["dispatch", "first", "finish", "beat", "report", "time", "look"]),
        st.integers(min_value=0, max_value=2),
        st.integers(min_value=0, max_value=5),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_a_view_is_never_stale(steps: list[tuple[str, int, int]]) -> None:
    led = InflightLedger()
    rng = random.Random(len(steps))
    now = 10.0
    views = {
        n: node_view(n, used=5, running=1, waiting=0, kv_blocks_total=100, heartbeat_ts=now)
        for n in NODES
    }
    beats = dict.fromkeys(NODES, now)
    reported = dict.fromkeys(NODES, 0.0)
    live: list[str] = []
    for i, (op, k, r) in enumerate(steps):
        node = NODES[k]
        now += 0.01 * (r + 1)
        if op == "dispatch":
            rid = f"r{i}"
            led.dispatch(rid, node, now, 500 * r + 100, expected_output=64 * r)
            live.append(rid)
        elif op == "first" and live:
            # long prefills at varied speeds teach the group's rate
            led.first_token(live[r % len(live)], now + rng.random())
        elif op == "finish" and live:
            led.finish(live.pop(r % len(live)), now, 50)
        elif op == "beat":
            beats[node] = now
            views[node] = replace(views[node], heartbeat_ts=now, running=r)
        elif op == "report":
            reported[node] = 1000.0 * r
        elif op == "time":
            now += 0.5 * r
        for n in NODES:  # the decision's loop, every step
            got = led.view(views[n], beats[n], now, "m", reported[n])
            assert _seen(got) == _expected(led, views[n], beats[n], now, reported[n]), (op, n)
            assert got.node_id == n and got.heartbeat_ts == views[n].heartbeat_ts
