import pytest

from streams.folds import KvCursor, heartbeat_is_newer, plan_kv
from streams.schemas import Heartbeat, KvEventBatch
from streams.segments import parse_segment_key, segment_key
from tests.factories import heartbeat


def batch(seq: int, epoch: str = "e1", **kw: object) -> KvEventBatch:
    return KvEventBatch(node_id="n", epoch=epoch, seq=seq, ts=1.0, block_size=16, **kw)  # type: ignore[arg-type]


def hb(epoch: str, seq: int) -> Heartbeat:
    return heartbeat("n", seq=seq, epoch=epoch)


def test_delta_upserts_new_and_deletes_present_only() -> None:
    plan = plan_kv(KvCursor("e1", 0), {1, 2}, batch(1, stored=[2, 3], removed=[1, 9]))
    assert plan.apply and not plan.gap
    assert sorted(plan.upserts) == [3] and plan.deletes == [1]
    assert plan.cursor == KvCursor("e1", 1)


@pytest.mark.parametrize("cursor", [KvCursor("e1", 5), KvCursor("e1", 6), KvCursor("e2", 0)])
def test_replayed_or_older_batches_are_skipped(cursor: KvCursor) -> None:
    plan = plan_kv(cursor, {1}, batch(5, stored=[7]))
    assert not plan.apply and plan.cursor == cursor


def test_gap_is_flagged_but_applied() -> None:
    plan = plan_kv(KvCursor("e1", 1), set(), batch(4, stored=[7]))
    assert plan.apply and plan.gap


def test_snapshot_replaces_the_node_state_even_from_a_new_epoch() -> None:
    plan = plan_kv(
        KvCursor("e1", 9), {1, 2, 3}, batch(0, epoch="e2", kind="snapshot", stored=[3, 4])
    )
    assert plan.apply and not plan.gap
    assert sorted(plan.deletes) == [1, 2] and plan.upserts == [4]


def test_cleared_drops_everything_then_stores() -> None:
    plan = plan_kv(KvCursor("e1", 1), {1, 2}, batch(2, cleared=True, stored=[5]))
    assert sorted(plan.deletes) == [1, 2] and plan.upserts == [5]


def test_applying_twice_is_a_no_op() -> None:
    state: set[int] = set()
    cursor = None
    b = batch(0, kind="snapshot", stored=[1, 2])
    for _ in range(2):
        plan = plan_kv(cursor, state, b)
        if plan.apply:
            state -= set(plan.deletes)
            state |= set(plan.upserts)
            cursor = plan.cursor
    assert state == {1, 2} and cursor == KvCursor("e1", 0)


def test_heartbeat_order_and_keys() -> None:
    assert heartbeat_is_newer(None, hb("e1", 0))
    assert heartbeat_is_newer(hb("e1", 3), hb("e1", 4))
    assert not heartbeat_is_newer(hb("e1", 4), hb("e1", 4))
    assert heartbeat_is_newer(hb("e1", 9), hb("e2", 0))
    assert parse_segment_key(segment_key("node|x", "d", 15)) == ("node|x", "d", 15)
    assert KvCursor.decode(KvCursor("1-a/b", 7).encode()) == KvCursor("1-a/b", 7)
