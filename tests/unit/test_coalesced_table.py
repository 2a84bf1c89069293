"""The worker's table writes wait for the commit (streams.coalesced.CoalescedTable): the last value
per key is written once, a key set and deleted in one interval costs nothing, writes for a
partition the worker no longer owns are dropped, the records wait in the outbox the commit sends,
and the store Faust restores from holds what
was written (with the partition recovery needs to drop a revoked partition's keys)."""

from __future__ import annotations

from types import SimpleNamespace

from faust.stores.memory import Store

from streams.coalesced import CoalescedTable


class _Table:
    """A Faust table's two parts the worker uses: its store and its changelog topic's name;
    ``outbox`` is where its records wait for the commit to send them."""

    def __init__(self) -> None:
        self.data = Store.__new__(Store)
        self.data.data = {}
        self.data._key_partition = {}
        self.changelog_topic = SimpleNamespace(get_topic_name=lambda: "ns.load-changelog")
        self.outbox: list[tuple[str, int, bytes, bytes | None]] = []

    @property
    def sent(self) -> list[tuple[int, bytes, bytes | None]]:
        assert all(topic == "ns.load-changelog" for topic, *_ in self.outbox)
        return [(partition, key, value) for _, partition, key, value in self.outbox]


def coalesced(table: _Table) -> CoalescedTable:
    return CoalescedTable(table, table.outbox)


def test_the_last_value_per_key_is_written_once_at_the_commit() -> None:
    table = _Table()
    t = coalesced(table)
    for i in range(10):
        t.put(1, b"n1", f"hb{i}".encode())
    assert table.sent == [] and t.get(b"n1") == b"hb9"
    assert t.write({0, 1}) == 1
    assert table.sent == [(1, b"n1", b"hb9")]
    assert t.items() == [(b"n1", b"hb9")] and t.partition_of(b"n1") == 1
    assert t.write({0, 1}) == 0  # nothing new


def test_a_key_opened_and_closed_in_one_interval_costs_nothing() -> None:
    table = _Table()
    t = coalesced(table)
    t.put(2, b"r1", b"reserve")
    t.put(2, b"r1", None)
    assert t.get(b"r1") is None
    assert t.write({2}) == 0 and table.sent == []


def test_a_delete_of_a_written_key_is_a_tombstone() -> None:
    table = _Table()
    t = coalesced(table)
    t.put(0, b"r1", b"reserve")
    t.write({0})
    t.put(0, b"r1", None)
    assert t.write({0}) == 1
    assert table.sent[-1] == (0, b"r1", None)
    assert t.items() == [] and t.partition_of(b"r1") == -1


def test_writes_for_a_partition_not_held_wait_and_are_dropped_once_it_is_lost() -> None:
    table = _Table()
    t = coalesced(table)
    t.put(0, b"mine", b"x")
    t.put(3, b"later", b"y")
    assert t.write({0}) == 1  # a commit carries partition 0 only: partition 3's write waits
    assert [k for _, k, _ in table.sent] == [b"mine"] and t.get(b"later") == b"y"
    assert t.write({0, 3}) == 1 and table.sent[-1] == (3, b"later", b"y")
    t.put(3, b"gone", b"z")
    t.drop({0})  # a rebalance took partition 3 away: its new owner folds that input again
    assert t.get(b"gone") is None and t.write({0, 3}) == 0


def test_after_a_rebalance_the_kept_entries_are_written_again() -> None:
    table = _Table()
    t = coalesced(table)
    t.put(0, b"n1", b"hb1")
    t.put(3, b"n2", b"hb2")
    t.write({0, 3})
    t.put(0, b"n1", b"hb3")  # a newer value is pending: it wins
    t.rewrite({0})  # partition 3 went away; 0 was kept
    assert t.write({0}) == 1 and table.sent[-1] == (0, b"n1", b"hb3")
    t.rewrite({0})
    assert t.write({0}) == 1 and table.sent[-1] == (0, b"n1", b"hb3")
