from router.decision.recent import RecentPrefills, merge_matches


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


def test_match_is_the_walk_down_the_prompt_on_random_prefix_chains() -> None:
    import random

    rng = random.Random(7)
    r = RecentPrefills(ttl_s=1.0, max_blocks=12)
    stamps: dict[tuple[str, int], float] = {}
    # chains: a prompt's block i is named by the tree path to it (prefix-closed, like hashes)
    roots = [(k,) for k in range(3)]
    now = 0.0
    for _ in range(400):
        now += rng.expovariate(20.0)
        root = rng.choice(roots)
        turns = [rng.randint(0, 1) for _ in range(20)]
        path = [hash((*root, *turns[:i])) for i in range(20)]
        prompt = path[: rng.randint(1, 20)]
        if rng.random() < 0.5:
            node = rng.choice(("a", "b", "c"))
            r.add(node, prompt, now)
            for h in prompt[:12]:
                stamps[(node, h)] = now
        else:
            want = {}
            for node in ("a", "b", "c"):
                depth = 0
                while depth < len(prompt) and stamps.get((node, prompt[depth]), -9) > now - 1.0:
                    depth += 1
                if depth:
                    want[node] = depth
            assert r.match(prompt, now) == want
