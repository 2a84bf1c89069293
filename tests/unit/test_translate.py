from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from agents.kvcache import AllCleared, BlockRemoved, BlockStored
from agents.kvtranslate import KvTranslator
from agents.vllm_events import decode_batch, encode_batch
from streams.blocks import chain_hashes


def test_legacy_vllm_wire_format_is_a_tagged_array() -> None:
    import msgspec

    raw = encode_batch(
        [BlockStored((1,), None, (5,) * 4), BlockRemoved((1,)), AllCleared()],
        4,
        ts=1.5,
        shape="array",
    )
    # vLLM's structs declare lora_id and medium without defaults: they are always on the wire
    assert msgspec.msgpack.decode(raw) == [
        1.5,
        [
            ["BlockStored", [1], None, [5, 5, 5, 5], 4, None, "GPU"],
            ["BlockRemoved", [1], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,  # data_parallel_rank: vLLM's publisher always sets it
    ]
    assert len(decode_batch(raw).events) == 3


def test_current_vllm_wire_format_has_map_events() -> None:
    import msgspec

    raw = encode_batch([BlockStored((1,), None, (5,) * 4), BlockRemoved((1,))], 4, ts=1.5)
    # vLLM >= 0.26: events are maps with a "type" tag; lora_id, medium and lora_name have no
    # default (always written), the rest are omitted when None; the batch stays an array. The
    # block pool always fills the per-block extra keys and the KV cache group
    assert msgspec.msgpack.decode(raw) == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": [5, 5, 5, 5],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None],
                "group_idx": 0,
            },
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0},
        ],
        0,
    ]
    assert len(decode_batch(raw).events) == 2


def test_engine_hashes_are_translated_to_kvgate_chain_hashes() -> None:
    tokens = list(range(12))
    expect = chain_hashes(tokens, 4)
    t = KvTranslator(block_size=4)
    # the engine uses its own ids (100, 101, 102) and splits the chain over two events
    t.apply(decode_batch(encode_batch([BlockStored((100, 101), None, tuple(tokens[:8]))], 4)))
    t.apply(decode_batch(encode_batch([BlockStored((102,), 101, tuple(tokens[8:]))], 4)))
    d = t.take_delta()
    assert sorted(d.stored) == sorted(expect) and not d.removed and not d.cleared
    t.apply(decode_batch(encode_batch([BlockRemoved((102,))], 4)))
    assert t.take_delta().removed == [expect[2]]


def test_net_delta_cancels_store_then_remove_and_unknown_parent_is_counted() -> None:
    t = KvTranslator(block_size=2)
    t.apply(decode_batch(encode_batch([BlockStored((1,), None, (1, 2))], 2)))
    t.apply(decode_batch(encode_batch([BlockRemoved((1,))], 2)))
    assert t.take_delta().empty
    t.apply(decode_batch(encode_batch([BlockStored((9,), 8, (1, 2))], 2)))
    assert t.untranslatable_blocks == 1 and t.blocks == 0


def test_clear_is_forwarded_and_snapshot_holds_the_current_set() -> None:
    t = KvTranslator(block_size=2)
    t.apply(decode_batch(encode_batch([BlockStored((1, 2), None, (1, 2, 3, 4))], 2)))
    t.take_delta()
    t.apply(decode_batch(encode_batch([AllCleared(), BlockStored((3,), None, (5, 6))], 2)))
    d = t.take_delta()
    assert d.cleared and d.stored == chain_hashes([5, 6], 2)
    assert t.snapshot() == chain_hashes([5, 6], 2)


def test_newer_vllm_batches_with_bytes_hashes_and_extra_fields_decode() -> None:
    import msgspec

    raw = msgspec.msgpack.encode(
        [
            2.0,
            [
                ["BlockStored", [b"\x01" * 32], None, [1, 2], 2, None, None, "lora-a", None, 0],
                ["BlockRemoved", [b"\x01" * 32], None, 0],
            ],
            0,
        ]
    )
    t = KvTranslator(block_size=2)
    t.apply(decode_batch(raw))
    assert t.blocks == 0 and t.take_delta().empty  # stored then removed


def _page_events(tokens: list[int], page: int, cuts: list[int]) -> tuple[list[object], list[int]]:
    """One chain of engine pages of ``page`` tokens (hashes 1, 2, …), stored in events cut at
    ``cuts`` (page indices), as an engine with that page size would publish them."""
    from agents.vllm_events import StoredEvent

    n = len(tokens) // page
    hashes = list(range(1, n + 1))
    bounds = sorted({0, n, *(c for c in cuts if 0 < c < n)})
    events: list[object] = []
    for a, b in pairwise(bounds):
        events.append(
            StoredEvent(
                hashes[a:b], hashes[a - 1] if a else None, tokens[a * page : b * page], page
            )
        )
    return events, hashes


@settings(max_examples=300, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4, 8, 16, 24, 32, 48]),
    n_tokens=st.integers(0, 200),
    cuts=st.lists(st.integers(0, 200), max_size=6),
    evict=st.lists(st.integers(1, 200), max_size=12),
)
def test_engine_pages_of_any_size_make_the_routers_blocks(
    page: int, n_tokens: int, cuts: list[int], evict: list[int]
) -> None:
    """Whatever the engine's page size, the index holds exactly the router's 16-token blocks
    whose every token sits in a page the engine still holds."""
    from agents.vllm_events import EngineBatch, RemovedEvent

    tokens = [(7 * i + 3) % 50_000 for i in range(n_tokens)]
    events, hashes = _page_events(tokens, page, cuts)
    gone = {h for h in evict if h <= len(hashes)}
    events.append(RemovedEvent(sorted(gone), None, None))
    t = KvTranslator(block_size=16)
    t.apply(EngineBatch(1.0, events, 0, 0))  # type: ignore[arg-type]
    held_tokens = len(hashes) * page
    want = {
        h
        for k, h in enumerate(chain_hashes(tokens[:held_tokens], 16))
        # pages holding tokens 16k .. 16k+15
        if not any(p + 1 in gone for p in range(16 * k // page, (16 * k + 15) // page + 1))
    }
    assert set(t.snapshot()) == want
    assert t.untranslatable_blocks == 0


def test_a_page_stored_again_after_its_eviction_restores_the_block() -> None:
    from agents.vllm_events import EngineBatch, RemovedEvent, StoredEvent

    tokens = list(range(32))
    events, hashes = _page_events(tokens, 4, [])
    t = KvTranslator(block_size=16)
    t.apply(EngineBatch(1.0, events, 0, 0))  # type: ignore[arg-type]
    t.apply(EngineBatch(2.0, [RemovedEvent([hashes[-1]], None, None)], 0, 0))
    assert set(t.snapshot()) == set(chain_hashes(tokens[:16], 16))
    t.apply(EngineBatch(3.0, [StoredEvent([hashes[-1]], hashes[-2], tokens[28:], 4)], 0, 0))
    assert set(t.snapshot()) == set(chain_hashes(tokens, 16))
