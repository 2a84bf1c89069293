import pytest

from agents.kvcache import AllCleared, BlockRemoved, BlockStored, KvCache, OutOfBlocks


def test_commit_publishes_stored_and_duplicates_are_shared() -> None:
    c = KvCache(num_blocks=8, block_size=4)
    c.allocate(2)
    c.commit([11, 12], None, list(range(8)))
    assert c.drain_events() == [BlockStored((11, 12), None, tuple(range(8)))]
    c.allocate(1)
    c.commit([11], None, list(range(4)))  # computed again by another request
    assert c.drain_events() == []
    assert c.used_blocks == 2 and c.cached_blocks == 2


def test_unreferenced_blocks_stay_reusable_until_evicted_lru_tail_first() -> None:
    c = KvCache(num_blocks=4, block_size=1)
    c.allocate(3)
    c.commit([1, 2, 3], None, [0, 0, 0])
    c.release([1, 2, 3], 0)
    assert c.used_blocks == 0 and c.match_prefix([1, 2, 3]) == 3
    c.drain_events()
    c.allocate(3)  # one empty block, then evict two: the tail of the prefix goes first
    assert c.drain_events() == [BlockRemoved((3, 2))]
    assert c.match_prefix([1, 2, 3]) == 1


def test_acquire_pins_cached_blocks_against_eviction() -> None:
    c = KvCache(num_blocks=2, block_size=1)
    c.allocate(2)
    c.commit([1, 2], None, [0, 0])
    c.release([1, 2], 0)
    assert c.can_allocate(1, reuse=[1])
    assert not c.can_allocate(2, reuse=[1])
    c.acquire([1])
    with pytest.raises(OutOfBlocks):
        c.allocate(2)


def test_clear_only_when_nothing_is_in_use() -> None:
    c = KvCache(num_blocks=4, block_size=1)
    c.allocate(1)
    assert not c.clear()
    c.commit([5], None, [0])
    c.release([5], 0)
    c.drain_events()
    assert c.clear()
    assert c.drain_events() == [AllCleared()] and c.cached_blocks == 0


def test_commit_each_is_one_commit_per_block() -> None:
    one, many = KvCache(16, 4), KvCache(16, 4)
    for c in (one, many):
        c.allocate(5)
        c.commit([7], None, ())  # 7 already cached: a duplicate is shared, not stored twice
        c.release([7], 0)
    blocks = [(1, None), (7, 3), (9, 8)]
    for h, parent in blocks:
        one.commit([h], parent, ())
    many.commit_each(blocks)
    assert one.drain_events() == many.drain_events()
    assert one._refs == many._refs and list(one._lru) == list(many._lru)
    assert one.used_blocks == many.used_blocks == 4
