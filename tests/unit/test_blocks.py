from streams.blocks import approx_tokenize, block_hash, chain_hashes, detokenize_approx


def test_tokenize_roundtrip_and_padding() -> None:
    assert detokenize_approx(approx_tokenize("abcdefgh")) == "abcdefgh"
    assert len(approx_tokenize("abcde")) == 2  # padded to a whole token


def test_chain_hashes_share_exactly_the_common_prefix() -> None:
    a = list(range(64))
    b = list(range(48)) + [999] * 16
    ha, hb = chain_hashes(a, 16), chain_hashes(b, 16)
    assert ha[:3] == hb[:3]
    assert ha[3] != hb[3]


def test_partial_block_is_not_hashed_and_parent_matters() -> None:
    assert len(chain_hashes(list(range(31)), 16)) == 1
    tokens = list(range(16))
    assert block_hash(None, tokens) != block_hash(block_hash(None, tokens), tokens)
    assert all(0 <= h < 2**63 for h in chain_hashes(list(range(160)), 16))


def test_continuing_a_chain_equals_hashing_the_whole() -> None:
    toks = list(range(80))
    whole = chain_hashes(toks, 16)
    head = chain_hashes(toks[:32], 16)
    assert head + chain_hashes(toks[32:], 16, parent=head[-1]) == whole


def test_chain_hashes_equal_folding_block_hash() -> None:
    toks = [(i * 7919) % 100_000 for i in range(100)]
    parent = None
    folded = []
    for start in range(0, 96, 16):
        parent = block_hash(parent, toks[start : start + 16])
        folded.append(parent)
    assert chain_hashes(toks, 16) == folded


def test_long_prompts_hash_and_tokenize_as_one_piece() -> None:
    """Past one conversion slice (65,536 tokens) the hashes are still the fold of block_hash,
    for block sizes that do and do not divide the slice."""
    toks = [(i * 7919) % 50_000 for i in range(150_000)]
    for size in (16, 48):
        want: list[int] = []
        for i in range(0, len(toks) // size * size, size):
            want.append(block_hash(want[-1] if want else None, toks[i : i + size]))
        assert chain_hashes(toks, size) == want
    text = "a long prompt of many words " * 20_000  # 560,000 bytes: many slices
    assert detokenize_approx(approx_tokenize(text)) == text
