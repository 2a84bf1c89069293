"""The reconciler's rules on the KV ledger, the reservation store and the nodes' report."""

from __future__ import annotations

from admission.reconcile import ReconcilePlan, plan_reconcile
from admission.reservations import Reservation
from streams.ledger import LedgerBook
from streams.schemas import LedgerEvent

LEASE = 600.0
GRACE = 10.0


def reserve(rid: str, ts: float, blocks: int = 10, pool: str = "default") -> LedgerEvent:
    return LedgerEvent(
        reservation_id=rid,
        pool=pool,
        kind="reserve",
        kv_blocks=blocks,
        router_id="r1",
        ts=ts,
        lease_expires_at=ts + LEASE,
    )


def close(rid: str, ts: float, kind: str = "release") -> LedgerEvent:
    return LedgerEvent(
        reservation_id=rid,
        kind=kind,  # type: ignore[arg-type]
        kv_blocks=10,
        router_id="r1",
        ts=ts,
    )


def held(rid: str, made: float, blocks: int = 10) -> Reservation:
    return Reservation(rid, "default", blocks, 1, made + LEASE)


def plan(
    book: LedgerBook,
    store: dict[str, Reservation],
    now: float,
    *,
    store_reset: bool = False,
    suspects: dict[str, float] | None = None,
    sole_owner: str | None = None,
    own: set[str] | None = None,
    idle_since: dict[str, float] | None = None,
) -> ReconcilePlan:
    return plan_reconcile(
        book.open,
        book.closed,
        store,
        now,
        lease_s=LEASE,
        grace_s=GRACE,
        store_reset=store_reset,
        suspects=suspects or {},
        sole_owner=sole_owner,
        own=own or set(),
        idle_since=idle_since,
    )


def test_book_folds_idempotently_and_remembers_closures() -> None:
    book = LedgerBook(closed_memory_s=60)
    events = [reserve("a", 1.0), reserve("b", 2.0), close("a", 3.0)]
    for ev in events + events:  # a replay folds to the same book
        book.apply(ev, 3.0)
    assert set(book.open) == {"b"}
    assert "a" in book.closed
    assert book.held("default") == (10, 1)
    book.apply(reserve("a", 4.0), 4.0)  # an id reused after it closed opens again
    assert set(book.open) == {"a", "b"}
    assert "a" not in book.closed
    book.apply(close("b", 5.0, "expire"), 5.0)
    book.forget_closed(100.0)
    assert not book.closed


def test_consistent_views_need_nothing() -> None:
    book = LedgerBook()
    book.apply(reserve("a", 100.0), 100.0)
    p = plan(book, {"a": held("a", 100.0)}, 200.0)
    assert len(p) == 0 and not p.suspects


def test_store_reset_restores_open_reservations() -> None:
    book = LedgerBook()
    for rid in ("a", "b", "c"):
        book.apply(reserve(rid, 100.0), 100.0)
    book.apply(close("c", 101.0), 101.0)
    p = plan(book, {}, 102.0, store_reset=True)
    assert sorted(e.reservation_id for e in p.restore) == ["a", "b"]
    assert not p.compensate


def test_store_reset_does_not_restore_what_outlived_its_lease() -> None:
    book = LedgerBook()
    book.apply(reserve("old", 1.0), 1.0)
    p = plan(book, {}, LEASE + 2, store_reset=True)
    assert not p.restore
    assert [e.reservation_id for e, _ in p.compensate] == ["old"]


def test_a_lost_release_is_closed_only_after_the_grace() -> None:
    book = LedgerBook()
    book.apply(reserve("a", 100.0), 100.0)
    first = plan(book, {}, 200.0)  # maybe a release whose event is on its way
    assert len(first) == 0 and first.suspects == {"a": 200.0}
    second = plan(book, {}, 205.0, suspects=first.suspects)
    assert len(second) == 0
    third = plan(book, {}, 210.0, suspects=second.suspects)
    assert [e.reservation_id for e, _ in third.compensate] == ["a"]


def test_a_swept_lease_is_closed_only_after_its_expire_event_had_the_grace() -> None:
    """A sweep removes a lapsed reservation from the store and records its expiry; a pass
    that runs before that event is read must not record a second one."""
    book = LedgerBook()
    book.apply(reserve("a", 100.0), 100.0)
    lapsed = 100.0 + LEASE
    assert len(plan(book, {}, lapsed + 0.01)) == 0  # just swept: its event is on its way
    book.apply(close("a", lapsed, "expire"), lapsed + 0.2)
    assert len(plan(book, {}, lapsed + GRACE)) == 0
    book.apply(reserve("b", 100.0), 100.0)  # swept by a router that died before recording it
    p = plan(book, {}, lapsed + GRACE)
    assert [e.reservation_id for e, _ in p.compensate] == ["b"]


def test_release_event_arriving_clears_the_suspicion() -> None:
    book = LedgerBook()
    book.apply(reserve("a", 100.0), 100.0)
    first = plan(book, {}, 200.0)
    book.apply(close("a", 200.5), 200.5)
    second = plan(book, {}, 215.0, suspects=first.suspects)
    assert len(second) == 0 and not second.suspects


def test_store_only_entries_are_adopted_after_the_grace_or_dropped_when_closed() -> None:
    book = LedgerBook()
    book.apply(reserve("closed", 100.0), 100.0)
    book.apply(close("closed", 101.0), 101.0)
    store = {
        "closed": held("closed", 100.0),  # released while the store was unreachable
        "lost": held("lost", 100.0),  # its reserve event never made it
        "young": held("young", 199.0),  # its reserve event is on its way
    }
    p = plan(book, store, 200.0)
    assert [r.reservation_id for r in p.drop] == ["closed"]
    assert [r.reservation_id for r in p.adopt] == ["lost"]


def test_sole_owner_closes_what_it_does_not_hold() -> None:
    book = LedgerBook()
    book.apply(reserve("mine", 100.0), 100.0)
    book.apply(reserve("dead", 100.0), 100.0)  # from before this router restarted
    store = {"mine": held("mine", 100.0)}
    p = plan(book, store, 120.0, sole_owner="r1", own={"mine"})
    assert [e.reservation_id for e, _ in p.compensate] == ["dead"]


def test_reservations_held_while_the_pool_idles_are_orphans() -> None:
    book = LedgerBook()
    book.apply(reserve("a", 100.0), 100.0)
    book.apply(reserve("b", 100.0), 100.0)
    store = {"a": held("a", 100.0), "b": held("b", 100.0)}
    assert len(plan(book, store, 105.0, idle_since={"default": 100.0})) == 0
    p = plan(book, store, 112.0, idle_since={"default": 101.0})
    assert sorted(r.reservation_id for r in p.orphans) == ["a", "b"]
    busy = plan(book, store, 112.0, idle_since={"other": 50.0})
    assert len(busy) == 0


def renew(rid: str, ts: float, until: float) -> LedgerEvent:
    return LedgerEvent(
        schema_version=2,
        reservation_id=rid,
        kind="renew",
        kv_blocks=10,
        router_id="r1",
        ts=ts,
        lease_expires_at=until,
    )


def test_a_renew_moves_an_open_lease_and_reopens_nothing() -> None:
    book = LedgerBook()
    book.apply(reserve("a", 1.0), 1.0)
    for _ in range(2):  # idempotent
        book.apply(renew("a", 300.0, 900.0), 300.0)
    assert book.open["a"].lease_expires_at == 900.0 and book.open["a"].ts == 1.0
    book.apply(close("a", 400.0, "expire"), 400.0)
    book.apply(renew("a", 401.0, 1001.0), 401.0)  # late: the reservation closed already
    assert "a" not in book.open and "a" in book.closed
    book.apply(renew("b", 1.0, 601.0), 1.0)  # never opened
    assert not book.open


def test_a_renewed_reservation_is_not_taken_for_a_lost_one() -> None:
    book = LedgerBook()
    book.apply(reserve("a", 1.0), 1.0)
    book.apply(renew("a", 400.0, 1000.0), 400.0)
    # Redis lost it after the first lease would have run out: restored, not compensated
    p = plan(book, {}, 700.0, store_reset=True)
    assert [e.reservation_id for e in p.restore] == ["a"] and not p.compensate
    assert p.restore[0].lease_expires_at == 1000.0


def test_renew_events_are_version_2_with_a_lease() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="renew"):
        LedgerEvent(reservation_id="a", kind="renew", kv_blocks=1, router_id="r", ts=1.0)
    with pytest.raises(ValidationError, match="renew"):
        LedgerEvent(
            schema_version=2,
            reservation_id="a",
            kind="renew",
            kv_blocks=1,
            router_id="r",
            ts=1.0,
        )
