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
    # default (always written), the rest are omitted when None; the batch stays an array
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
            },
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
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
