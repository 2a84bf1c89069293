"""vLLM's KV-cache event wire format (``vllm/distributed/kv_events.py``), and a publisher.

vLLM publishes msgpack-encoded ``KVEventBatch`` structs over a ZeroMQ PUB socket as three frames:
``[topic, sequence number (8 bytes, big-endian), payload]``. Each event is a tagged array
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``).
A ROUTER socket answers replay requests: the client sends a start sequence number (8 bytes) and gets
``[seq, payload]`` frames for every buffered batch from there, then ``[-1, b""]``.
The simulated engine publishes this format; the agent's vLLM adapter reads it, so the same code runs
against a real vLLM.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from agents.kvcache import AllCleared, BlockRemoved, BlockStored, CacheEvent

log = logging.getLogger(__name__)

__all__ = [
    "AllBlocksClearedMsg",
    "BlockRemovedMsg",
    "BlockStoredMsg",
    "EngineHash",
    "KVEventBatchMsg",
    "KvEventPublisher",
    "KvEventSubscriber",
    "decode_batch",
    "encode_batch",
]


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


# vLLM's ExternalBlockHash is ``bytes | int`` (newer releases send bytes). Fields that newer
# releases append (lora_name, extra_keys, group_idx) are ignored: msgspec skips trailing items.
EngineHash = int | bytes


class BlockStoredMsg(_Event, tag="BlockStored"):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemovedMsg(_Event, tag="BlockRemoved"):
    block_hashes: list[EngineHash]
    medium: str | None = None


class AllBlocksClearedMsg(_Event, tag="AllBlocksCleared"):
    pass


class KVEventBatchMsg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStoredMsg | BlockRemovedMsg | AllBlocksClearedMsg]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatchMsg)


def encode_batch(events: Sequence[CacheEvent], block_size: int, ts: float | None = None) -> bytes:
    msgs: list[BlockStoredMsg | BlockRemovedMsg | AllBlocksClearedMsg] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            msgs.append(
                BlockStoredMsg(
                    list[EngineHash](ev.block_hashes),
                    ev.parent_block_hash,
                    list(ev.token_ids),
                    block_size,
                )
            )
        elif isinstance(ev, BlockRemoved):
            msgs.append(BlockRemovedMsg(list[EngineHash](ev.block_hashes)))
        elif isinstance(ev, AllCleared):
            msgs.append(AllBlocksClearedMsg())
    return _encoder.encode(KVEventBatchMsg(ts if ts is not None else time.time(), msgs))


def decode_batch(payload: bytes) -> KVEventBatchMsg:
    return _decoder.decode(payload)


class KvEventPublisher:
    """ZeroMQ PUB of KV event batches with a bounded replay buffer served on a ROUTER socket."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "kv-events",
        buffer_batches: int = 10_000,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
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
        self, endpoint: str, replay_endpoint: str | None = None, replay_timeout_s: float = 1.0
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None
        self.gaps = 0  # sequence gaps seen
        self.recovered = 0  # batches fetched by replay
        self.lost = 0  # batches neither received nor replayed
        self.undecodable = 0

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

    async def batches(self) -> AsyncIterator[tuple[int, KVEventBatchMsg, bool]]:
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
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
                    except Exception as exc:
                        self.undecodable += 1
                        log.warning("undecodable KV event batch %d: %s", s, exc)
                        continue
                    yield s, batch, restarted and i == 0
        finally:
            sub.close(linger=0)
