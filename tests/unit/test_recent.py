from router.recent import RecentPrefills, merge_matches


def test_a_completed_prefill_counts_until_it_expires() -> None:
    r = RecentPrefills(ttl_s=2.0)
    r.add("n1", [1, 2, 3], now=10.0)
    assert r.match([1, 2, 9], now=11.0) == {"n1": 2}
    r.add("n2", [1, 2], now=11.5)
    assert r.match([1, 2, 3], now=11.6) == {"n1": 3, "n2": 2}
    assert r.match([1, 2, 3], now=12.1) == {"n2": 2}  # n1's entry expired
    assert r.match([1], now=20.0) == {} and len(r) == 0


def test_a_newer_add_keeps_shared_blocks_alive() -> None:
    r = RecentPrefills(ttl_s=2.0)
    r.add("n1", [1, 2, 3], now=10.0)
    r.add("n1", [1, 2], now=11.0)
    assert r.match([1, 2, 3], now=12.5) == {"n1": 2}


def test_merge_keeps_the_longer_match() -> None:
    assert merge_matches({"a": 3, "b": 1}, {"b": 4, "c": 2}) == {"a": 3, "b": 4, "c": 2}
    assert merge_matches({"a": 3}, {}) == {"a": 3}
