"""vLLM's KV-cache event wire format (``vllm/distributed/kv_events.py``), and a publisher.

vLLM publishes msgpack-encoded ``KVEventBatch`` structs over a ZeroMQ PUB socket as three frames:
``[topic, sequence number (8 bytes, big-endian), payload]``. A ROUTER socket answers replay
requests: the client sends a start sequence number (8 bytes) and gets ``[seq, payload]`` frames
for every buffered batch from there, then ``[-1, b""]``.

Two shapes are in use, and both are decoded here, event by event (one bad event does not lose
its batch):

* **array** (vLLM up to ~0.25, SGLang): the batch ``[ts, events, data_parallel_rank]`` and each
  event a tagged array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, …]``;
* **map** (vLLM ≥ 0.26, SGLang 0.5): each event a map with named fields and a ``type`` tag
  (``{"type": "BlockStored", "block_hashes": …}``), defaults omitted; the batch stays an array
  in the releases seen (vLLM 0.33, SGLang 0.5.23), and a map is read too. SGLang names the
  rank ``attn_dp_rank`` and writes ``cache_salt`` as a field of its own.

Fields kvgate does not know are ignored. Block hashes are ints or bytes. The simulated engine
publishes the map shape by default (``engine.kv_events_shape: array`` for the legacy one); the
agent's vLLM adapter reads both, so the same code runs against a real vLLM.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import msgspec
import zmq
import zmq.asyncio

from agents.kvcache import AllCleared, BlockRemoved, BlockStored, CacheEvent

log = logging.getLogger(__name__)

__all__ = [
    "ClearedEvent",
    "EngineBatch",
    "EngineHash",
    "KvEventPublisher",
    "KvEventSubscriber",
    "RemovedEvent",
    "Shape",
    "StoredEvent",
    "decode_batch",
    "encode_batch",
]

# vLLM's ExternalBlockHash is ``bytes | int`` (newer releases send bytes)
EngineHash = int | bytes
Shape = Literal["map", "array"]


@dataclass(frozen=True, slots=True)
class StoredEvent:
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None  # GPU (None), CPU, disk… tiers
    extra_keys: list[Any] | None = None  # per block: multimodal keys, cache_salt, LoRA name
    group_idx: int | None = None  # KV cache group (hybrid models)
    kv_cache_spec_kind: str | None = None  # full_attention, sliding_window, mamba…
    cache_salt: str | None = None  # SGLang writes the salt itself (vLLM: in extra_keys)


@dataclass(frozen=True, slots=True)
class RemovedEvent:
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class ClearedEvent:
    pass


EngineEvent = StoredEvent | RemovedEvent | ClearedEvent


@dataclass(frozen=True, slots=True)
class EngineBatch:
    ts: float
    events: list[EngineEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None
    bad_events: int = 0  # events of this batch that could not be decoded (skipped)


# --- the wire structs, declared once for both shapes ---------------------------------------------
# (name, type[, default]) in vLLM's declaration order: the array shape is positional
_STORED_FIELDS: list[Any] = [
    ("block_hashes", list[EngineHash]),
    ("parent_block_hash", EngineHash | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None, None),
    ("medium", str | None, None),
    ("lora_name", str | None, None),
    ("extra_keys", list[Any] | None, None),
    ("group_idx", int | None, None),
    ("kv_cache_spec_kind", str | None, None),
    ("kv_cache_spec_sliding_window", int | None, None),
    ("locality", str | None, None),  # LOCAL / REMOTE to the publisher
    ("ownership", str | None, None),  # secondary offloading tier
    ("session_id", str | None, None),  # the request context that stored it
    ("lookahead_token_ids", list[list[int]] | None, None),
    ("cache_salt", str | None, None),  # SGLang: the salt of the request that stored them
]
_REMOVED_FIELDS: list[Any] = [
    ("block_hashes", list[EngineHash]),
    ("medium", str | None, None),
    ("group_idx", int | None, None),
    ("locality", str | None, None),
    ("ownership", str | None, None),
]
_BATCH_FIELDS: list[Any] = [
    ("ts", float),
    ("events", list[msgspec.Raw]),
    ("data_parallel_rank", int | None, None),
]


@dataclass(frozen=True)
class _Wire:
    stored: Any
    removed: Any
    cleared: Any
    batch: Any
    events: msgspec.msgpack.Decoder[Any]
    batches: msgspec.msgpack.Decoder[Any]


def _wire(array_like: bool, required: int = 4, legacy: bool = False) -> _Wire:
    """The structs of one shape. ``required``: how many leading BlockStored fields have no
    default (decoding: 4, lenient; encoding: what vLLM always writes — its ``lora_id`` and
    ``medium``, and in the map releases ``lora_name``, have no default). ``legacy``: only the
    fields of the array releases (``BlockStored`` up to ``medium``, ``BlockRemoved`` up to
    ``medium``), as they wrote them."""
    opts: dict[str, Any] = {"array_like": array_like, "omit_defaults": True, "gc": False}
    fields = [f[:2] if i < required else f for i, f in enumerate(_STORED_FIELDS)]
    stored_fields = fields[:6] if legacy else fields
    # BlockRemoved's medium has no default either (when written as vLLM does)
    removed_spec = [f[:2] if required > 4 and i < 2 else f for i, f in enumerate(_REMOVED_FIELDS)]
    removed_fields = removed_spec[:2] if legacy else removed_spec
    stored = msgspec.defstruct("BlockStored", stored_fields, tag=True, **opts)
    removed = msgspec.defstruct("BlockRemoved", removed_fields, tag=True, **opts)
    cleared = msgspec.defstruct("AllBlocksCleared", [], tag=True, **opts)
    batch = msgspec.defstruct("KVEventBatch", _BATCH_FIELDS, **opts)
    union: Any = Union[stored, removed, cleared]  # noqa: UP007 - a union of runtime classes
    return _Wire(
        stored,
        removed,
        cleared,
        batch,
        msgspec.msgpack.Decoder(union),
        msgspec.msgpack.Decoder(batch),
    )


_ARRAY, _MAP = _wire(True), _wire(False)  # decoding
# as vLLM writes them: ≤ 0.25 all arrays, ≥ 0.26 map events
_ARRAY_OUT, _MAP_OUT = _wire(True, required=6, legacy=True), _wire(False, required=7)
_encoder = msgspec.msgpack.Encoder()


def _shape_of(raw: bytes | msgspec.Raw) -> _Wire:
    """msgpack arrays start 0x90–0x9f, 0xdc or 0xdd; maps 0x80–0x8f, 0xde or 0xdf."""
    view = memoryview(raw)
    first = view[0] if len(view) else 0
    return _ARRAY if (0x90 <= first <= 0x9F or first in (0xDC, 0xDD)) else _MAP


def _event(msg: Any) -> EngineEvent:
    name = type(msg).__name__
    if name == "BlockStored":
        return StoredEvent(
            list(msg.block_hashes),
            msg.parent_block_hash,
            list(msg.token_ids),
            msg.block_size,
            msg.lora_id,
            msg.lora_name,
            msg.medium,
            msg.extra_keys,
            msg.group_idx,
            msg.kv_cache_spec_kind,
            msg.cache_salt,
        )
    if name == "BlockRemoved":
        return RemovedEvent(list(msg.block_hashes), msg.medium, msg.group_idx)
    return ClearedEvent()


def decode_batch(payload: bytes) -> EngineBatch:
    """One batch in either shape. Raises ``msgspec.DecodeError`` / ``ValidationError`` when the
    batch itself is unreadable; events that are not are skipped and counted (``bad_events``)."""
    env = _shape_of(payload).batches.decode(payload)
    events: list[EngineEvent] = []
    bad = 0
    for raw in env.events:
        try:
            events.append(_event(_shape_of(raw).events.decode(raw)))
        except (msgspec.DecodeError, msgspec.ValidationError):
            bad += 1
    return EngineBatch(env.ts, events, env.data_parallel_rank, bad)


def encode_batch(
    events: Sequence[CacheEvent],
    block_size: int,
    ts: float | None = None,
    shape: Shape = "map",
    data_parallel_rank: int = 0,
    lora_ids: Mapping[str, int] | None = None,
) -> bytes:
    """A batch as vLLM publishes it: ``map`` events in an array batch (vLLM ≥ 0.26), or all
    arrays (``array``, earlier releases). ``lora_ids``: the engine's integer id of each
    adapter. Map events name a request's adapter (``lora_name``) and carry vLLM's per-block
    extra keys: the adapter's name on every block, the ``cache_salt`` on the request's first;
    the array releases had only ``lora_id``. Like vLLM's block pool, map events always carry
    one extra-keys entry per block (``None`` when it has none) and the KV cache group."""
    w = _MAP_OUT if shape == "map" else _ARRAY_OUT
    msgs: list[Any] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            lora_id = (lora_ids or {}).get(ev.lora_name) if ev.lora_name else None
            # the fields after medium exist in the map releases only
            later = (
                [
                    ev.lora_name,
                    [_block_keys(ev, i) for i in range(len(ev.block_hashes))],
                    0,  # the KV cache group (one full-attention group)
                ]
                if shape == "map"
                else []
            )
            msgs.append(
                w.stored(
                    list[EngineHash](ev.block_hashes),
                    ev.parent_block_hash,
                    list(ev.token_ids),
                    block_size,
                    lora_id,
                    "GPU",
                    *later,
                )
            )
        elif isinstance(ev, BlockRemoved):
            group = [0] if shape == "map" else []
            msgs.append(w.removed(list[EngineHash](ev.block_hashes), "GPU", *group))
        elif isinstance(ev, AllCleared):
            msgs.append(w.cleared())
    raw = [msgspec.Raw(_encoder.encode(m)) for m in msgs]
    now = ts if ts is not None else time.time()
    return _encoder.encode(_ARRAY_OUT.batch(now, raw, data_parallel_rank))


def rank_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The KV-event endpoint of one data-parallel rank, as vLLM derives it: a tcp port moves up
    by the rank (port 0 stays for the OS to pick), an inproc/ipc name gets a ``_dp<rank>``
    suffix; rank 0 keeps the endpoint."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"a tcp endpoint needs a port: {endpoint!r}")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def _block_keys(ev: BlockStored, i: int) -> tuple[str, ...] | None:
    """vLLM's extra keys of the ``i``-th block of ``ev`` as its events write them: the adapter's
    name, then (on a request's first block) its salt."""
    keys = ([ev.lora_name] if ev.lora_name else []) + (
        [ev.cache_salt] if i == 0 and ev.cache_salt else []
    )
    return tuple(keys) or None


class KvEventPublisher:
    """ZeroMQ PUB of KV event batches with a bounded replay buffer served on a ROUTER socket."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "kv-events",
        buffer_batches: int = 10_000,
        connect: bool = False,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        if connect:  # dial out to a collector that binds (vLLM does so for non-wildcard hosts)
            self._pub.connect(endpoint)
        else:
            self._pub.bind(endpoint)
        self._replay: Any = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._seq = -1
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)

    async def publish(self, payload: bytes) -> int:
        self._seq += 1
        self._buffer.append((self._seq, payload))
        await self._pub.send_multipart(
            [self._topic, self._seq.to_bytes(8, "big", signed=True), payload]
        )
        return self._seq

    async def serve_replay(self) -> None:
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            identity, start = frames[0], int.from_bytes(frames[-1], "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        [identity, b"", seq.to_bytes(8, "big", signed=True), payload]
                    )
            await self._replay.send_multipart(
                [identity, b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


class KvEventSubscriber:
    """The consumer side of vLLM's KV events: SUB to the batches and, when sequence numbers jump,
    fetch the missing batches from the engine's replay socket (a DEALER to its ROUTER) before
    handing on the one that revealed the gap, so batches come out in order.

    :meth:`batches` yields ``(seq, batch, restarted)``; ``restarted`` is True when the sequence
    went backwards (the engine restarted: whatever was known of its cache is gone).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        replay_timeout_s: float = 1.0,
        bind: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.bind = bind
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None
        self.gaps = 0  # sequence gaps seen
        self.recovered = 0  # batches fetched by replay
        self.lost = 0  # batches neither received nor replayed
        self.undecodable = 0  # batches
        self.undecodable_events = 0  # events skipped in batches that decoded

    async def _replay(self, ctx: Any, start: int, end: int) -> list[tuple[int, bytes]]:
        """Batches ``start .. end - 1`` from the replay socket (what it still buffers)."""
        if self.replay_endpoint is None:
            return []
        sock = ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    break  # the engine did not answer (in time)
                frames = await sock.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq < 0:
                    break
                if start <= seq < end:
                    out.append((seq, frames[-1]))
        finally:
            sock.close(linger=0)
        return sorted(out)

    async def batches(self) -> AsyncIterator[tuple[int, EngineBatch, bool]]:
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if self.bind:  # the engine dials in (a collector-style deployment)
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        log.info(
            "KV events: %s %s (replay: %s)",
            "listening on" if self.bind else "subscribed to",
            self.endpoint,
            self.replay_endpoint or "none",
        )
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("ignoring a KV event message with %d frames", len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                last = self.last_seq
                restarted = last is not None and seq <= last
                pending = [(seq, frames[2])]
                if last is not None and seq > last + 1:
                    self.gaps += 1
                    replayed = await self._replay(ctx, last + 1, seq)
                    self.recovered += len(replayed)
                    self.lost += (seq - last - 1) - len(replayed)
                    if len(replayed) < seq - last - 1:
                        log.warning(
                            "KV events %d..%d: %d lost (replayed %d)",
                            last + 1,
                            seq - 1,
                            seq - last - 1 - len(replayed),
                            len(replayed),
                        )
                    pending = replayed + pending
                self.last_seq = seq
                for i, (s, payload) in enumerate(pending):
                    try:
                        batch = decode_batch(payload)
                    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                        self.undecodable += 1
                        if self.undecodable <= 10 or self.undecodable % 1000 == 0:
                            log.warning("undecodable KV event batch %d: %s", s, exc)
                        continue
                    if batch.bad_events:
                        self.undecodable_events += batch.bad_events
                        log.warning("KV event batch %d: %d undecodable events", s, batch.bad_events)
                    yield s, batch, restarted and i == 0
        finally:
            sub.close(linger=0)
