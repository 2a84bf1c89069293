"""KV-event batches made by vLLM's own classes (``tests/data/kv_events``, written by
``python -m tests.oracles.vllm_kv_events``): kvgate decodes every field of both wire shapes,
indexes exactly the blocks a request can hit, and its simulated engine writes the same bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agents.kvcache import BlockRemoved, BlockStored
from agents.kvtranslate import KvTranslator
from agents.vllm_events import (
    ClearedEvent,
    RemovedEvent,
    StoredEvent,
    decode_batch,
    encode_batch,
)
from streams.blocks import chain_hashes, chain_root, offloaded

DATA = Path(__file__).resolve().parents[1] / "data" / "kv_events"
VERSIONS = sorted(p.name for p in DATA.iterdir() if p.is_dir())
CASES = [
    (v, name)
    for v in VERSIONS
    for name in json.loads((DATA / v / "manifest.json").read_text())["cases"]
]
TOKENS = list(range(48))


def _plain(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"hex"}:
        return bytes.fromhex(v["hex"])
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _vector(version: str, name: str) -> tuple[bytes, dict[str, Any]]:
    manifest = json.loads((DATA / version / "manifest.json").read_text())
    return (DATA / version / f"{name}.msgpack").read_bytes(), manifest["cases"][name]


def test_both_wire_shapes_are_covered() -> None:
    first = {v: (DATA / v / "chain_int.msgpack").read_bytes()[0] for v in VERSIONS}
    shapes = {"array" if 0x90 <= b <= 0x9F else "map" for b in first.values()}
    assert len(VERSIONS) >= 2 and shapes == {"array"}  # the batch is an array in both ...
    events = {
        v: msgspec.msgpack.decode((DATA / v / "chain_int.msgpack").read_bytes())[1][0]
        for v in VERSIONS
    }
    assert {type(e).__name__ for e in events.values()} == {"list", "dict"}  # ... events differ


@pytest.mark.parametrize(("version", "name"), CASES)
def test_every_field_decodes(version: str, name: str) -> None:
    raw, case = _vector(version, name)
    batch = decode_batch(raw)
    assert batch.ts == case["ts"] and batch.data_parallel_rank == case["data_parallel_rank"]
    assert batch.bad_events == 0 and len(batch.events) == len(case["events"])
    for got, want in zip(batch.events, case["events"], strict=True):
        kind = {"BlockStored": StoredEvent, "BlockRemoved": RemovedEvent}
        assert isinstance(got, kind.get(want["type"], ClearedEvent))
        for field, value in want.items():
            if field in ("type", "kv_cache_spec_sliding_window", "locality", "ownership"):
                continue
            if field in ("session_id", "lookahead_token_ids"):
                continue
            expected = _plain(value)
            if field == "extra_keys" and expected is not None:
                expected = [list(k) if k is not None else None for k in expected]
            assert getattr(got, field) == expected, (field, got)


# what the prefix index may hold after each case: kvgate hashes of the hittable blocks
INDEXED = {
    "chain_int": chain_hashes(TOKENS[:32], 16),  # the third block was removed again
    "chain_bytes": chain_hashes(TOKENS, 16),
    "cleared": chain_hashes(TOKENS[:16], 16),
    "dp_rank_1": chain_hashes(TOKENS[:16], 16),
    # a CPU copy is not a GPU hit: indexed apart, as a cheaper miss
    "offloaded": [offloaded(h) for h in chain_hashes(TOKENS[:16], 16)],
    # GPU keeps the first block; the second lives on in CPU, and the third was stored there
    "offload_cycle": chain_hashes(TOKENS[:16], 16)
    + [offloaded(h) for h in chain_hashes(TOKENS, 16)[1:]],
    # chained from the adapter's name, as the router hashes a request for that adapter
    "lora": chain_hashes(TOKENS[:16], 16, chain_root(None, "adapter-a")),
    "lora_salt": chain_hashes(TOKENS[:32], 16, chain_root("salt-1", "adapter-a")),
    "lora_id_only": [],  # an adapter without a name: not reproducible
    "multimodal": [],  # an image's identifier is in the engine's hash
    "prompt_embeds": [],  # so is a digest of the prompt's embeddings
    # 32 one-token pages make two kvgate blocks; evicting the last page loses the second
    "page_1": chain_hashes(TOKENS[:16], 16),
    # chained from the salt, as the router hashes a request with that cache_salt
    "cache_salt": chain_hashes(TOKENS[:32], 16, chain_root("salt-1")),
    "hybrid": chain_hashes(TOKENS[:16], 16),  # the full-attention group's; the
    # sliding-window group's copy and its removal do not touch it
}
SKIPPED = {
    "lora_id_only": {"lora": 1},
    "multimodal": {"multimodal": 1},
    "prompt_embeds": {"prompt_embeds": 1},
    "hybrid": {"non_prefix_group": 1},
}


@pytest.mark.parametrize(("version", "name"), CASES)
def test_only_hittable_blocks_are_indexed(version: str, name: str) -> None:
    raw, _ = _vector(version, name)
    t = KvTranslator(block_size=16)
    t.apply(decode_batch(raw))
    assert sorted(t.snapshot()) == sorted(INDEXED[name])
    assert dict(t.skipped_blocks) == SKIPPED.get(name, {})
    assert t.untranslatable_blocks == 0


@pytest.mark.parametrize(("version", "shape"), [("vllm-0.33.0", "map"), ("vllm-0.11.0", "array")])
def test_the_simulated_engine_writes_vllms_bytes(version: str, shape: str) -> None:
    raw, case = _vector(version, "chain_int")
    events = [
        BlockStored((101, 102), None, tuple(TOKENS[:32])),
        BlockStored((103,), 102, tuple(TOKENS[32:48])),
        BlockRemoved((103,)),
    ]
    assert encode_batch(events, 16, ts=case["ts"], shape=shape) == raw  # type: ignore[arg-type]


def test_a_bad_event_does_not_lose_its_batch() -> None:
    raw, _ = _vector("vllm-0.33.0", "chain_int")
    ts, events, rank = msgspec.msgpack.decode(raw)
    events[1] = {"type": "BlockStored", "block_hashes": "not a list"}
    events.insert(0, {"type": "NoSuchEvent"})
    batch = decode_batch(msgspec.msgpack.encode([ts, events, rank]))
    assert batch.bad_events == 2 and len(batch.events) == 2
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\xc1 not msgpack")


def test_a_zero_or_empty_parent_is_the_root() -> None:
    for root in (0, b""):
        raw = msgspec.msgpack.encode(
            [1.0, [["BlockStored", [5], root, TOKENS[:16], 16, None, "GPU"]], 0]
        )
        t = KvTranslator(block_size=16)
        t.apply(decode_batch(raw))
        assert t.snapshot() == chain_hashes(TOKENS[:16], 16) and t.untranslatable_blocks == 0


def test_a_silent_or_untranslatable_event_feed_is_degraded() -> None:
    from agents.kvtranslate import KvHealth

    h = KvHealth(silence_s=10.0)
    h.scraped(0.0, 1000.0, 0)
    assert not h.degraded(5.0)
    h.scraped(12.0, 5000.0, 3)  # the engine prefilled 4,000 tokens, no batch ever arrived
    assert not h.degraded(12.0)  # (a batch may be on its way)
    h.scraped(23.0, 5000.0, 3)
    assert h.degraded(23.0) and "no KV events" in (h.reason or "")
    h.batch(24.0, translated=4, untranslatable=0)
    assert not h.degraded(25.0)
    h.scraped(40.0, 5000.0, 0)  # idle engine, no batches: nothing wrong
    assert not h.degraded(40.0)
    h.batch(41.0, translated=0, untranslatable=12)  # batches whose blocks cannot be chained
    assert h.degraded(42.0) and "chained" in (h.reason or "")
    h.batch(43.0, translated=3, untranslatable=0)
    assert not h.degraded(44.0)
    h.scraped(50.0, 10.0, 0)  # a counter going back: the engine restarted, not prefilling
    assert not h.degraded(70.0)


def test_prompt_tokens_reported_at_request_end_never_flip_a_node_to_degraded() -> None:
    """An engine that counts a request's prompt tokens when it finishes, after its KV events:
    a burst's counter growth trails its last batch by the requests' decode time."""
    from agents.kvtranslate import KvHealth

    h = KvHealth(silence_s=10.0)
    h.scraped(0.0, 0.0, 0)
    h.batch(0.5, translated=40, untranslatable=0)  # a burst of 8 requests prefilled
    counter, t = 0.0, 1.0
    for running in (8, 8, 6, 5, 5, 3, 2, 1, 1, 0, 0, 0):  # they finish over ~30 s
        counter += 0 if running == 8 else 2000.0
        h.scraped(t, counter, running)
        assert not h.degraded(t), (t, h.reason)
        t += 2.5
    for _ in range(20):  # and the engine stays idle
        h.scraped(t, counter, 0)
        assert not h.degraded(t)
        t += 5.0


def test_new_work_without_batches_is_degraded_even_under_steady_load() -> None:
    from agents.kvtranslate import KvHealth

    h = KvHealth(silence_s=10.0, tail_s=60.0)
    h.scraped(0.0, 0.0, 4)
    h.batch(0.5, translated=40, untranslatable=0)  # the last batch the router will see
    counter, t = 0.0, 1.0
    h.scraped(t, counter, 4)
    flipped = None
    while t < 200.0 and flipped is None:
        t += 1.0
        counter += 500.0  # prefilling all along, at a constant 4 requests
        h.scraped(t, counter, 4)
        flipped = t if h.degraded(t) else None
    assert flipped is not None and flipped <= 60.0 + 10.0 + 2.0  # tail_s, then silence_s
    h2 = KvHealth(silence_s=10.0)
    h2.scraped(0.0, 0.0, 2)
    h2.batch(0.5, translated=40, untranslatable=0)
    h2.scraped(1.0, 0.0, 2)
    h2.scraped(2.0, 0.0, 5)  # new requests arrive...
    h2.scraped(3.0, 3000.0, 5)  # ...and prefill with no batch
    assert not h2.degraded(12.0)
    h2.scraped(14.0, 6000.0, 5)
    assert h2.degraded(14.0)


def test_a_salted_request_hits_only_its_salts_blocks() -> None:
    """The router's hashes of a request with ``cache_salt`` are the blocks the agent indexed from
    the engines' salted events (vLLM's extra keys, SGLang's field), and no one else's."""
    import orjson

    from router.parse import parse_request

    body = {"model": "m", "prompt": TOKENS[:32], "max_tokens": 1}
    salted = parse_request(orjson.dumps({**body, "cache_salt": "salt-1"}), False, 16)
    other = parse_request(orjson.dumps({**body, "cache_salt": "salt-2"}), False, 16)
    plain = parse_request(orjson.dumps(body), False, 16)
    hashes = {
        p.cache_salt: chain_hashes(p.tokens, 16, chain_root(p.cache_salt))
        for p in (salted, other, plain)
    }
    assert len({tuple(h) for h in hashes.values()}) == 3  # nobody shares a block
    for version in (v for v in VERSIONS if (DATA / v / "cache_salt.msgpack").exists()):
        raw, _ = _vector(version, "cache_salt")
        t = KvTranslator(block_size=16)
        t.apply(decode_batch(raw))
        assert sorted(t.snapshot()) == sorted(hashes["salt-1"]), version


def test_the_simulated_engine_names_adapters_and_salts_as_vllm_does() -> None:
    raw, case = _vector("vllm-0.33.0", "lora_salt")
    events = [BlockStored((461, 462), None, tuple(TOKENS[:32]), "adapter-a", "salt-1")]
    assert encode_batch(events, 16, ts=case["ts"], lora_ids={"adapter-a": 3}) == raw  # type: ignore[arg-type]


def test_one_engine_restart_counts_once_whoever_sees_it_first() -> None:
    from agents.kvtranslate import Restarts

    r = Restarts(pair_s=30.0)
    assert r.seen("metrics", 100.0)  # counters went back (no process start time)
    assert not r.seen("events", 101.0)  # the event sequence started over: the same restart
    assert r.count == 1
    assert r.seen("events", 500.0)  # the next restart, events first this time
    assert not r.seen("metrics", 502.0)
    assert r.count == 2
    assert r.seen("metrics", 900.0)  # one the event stream never shows (no events flowing)
    assert r.seen("events", 2000.0)  # ...is not paired with one much later
    assert r.count == 4
