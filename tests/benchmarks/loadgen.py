"""Simulated node agents for the pipeline benchmark (a separate process: the load must not share
the measuring process's core).

Every node publishes a heartbeat every ``hb_interval_s`` and a KV batch every ``kv_interval_s``
with ``stored`` new blocks and ``removed`` old ones (its cache holds ``cache_blocks``). Stored block
hashes carry their production time (``ms << 20 | counter``) so that a reader can measure, per
block, the time from production to visibility. Messages are built as dicts and encoded with
orjson (the benchmark measures the pipeline, not pydantic); one of each is validated at start.
Each round of messages goes out as one record batch per partition, keyed by node and placed as
Kafka's default partitioner places a node's own records: the simulated fleet shares the
measuring machine's cores, so it spends as little of them as it can.

    python -m tests.benchmarks.loadgen --bootstrap 127.0.0.1:19092 --namespace ns --nodes 100 \
        --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner

from streams.schemas import Heartbeat, KvEventBatch
from streams.topics import HEARTBEATS, KV_EVENTS


def block_id(now_ms: int, counter: int) -> int:
    return (now_ms << 20) | (counter & 0xFFFFF)


def produced_ms(block: int) -> int:
    return block >> 20


async def run(args: argparse.Namespace) -> dict[str, float]:
    producer = AIOKafkaProducer(
        bootstrap_servers=args.bootstrap,
        linger_ms=5,
        acks=1,
        max_batch_size=1 << 20,
        compression_type=None,
    )
    await producer.start()
    hb_topic, kv_topic = HEARTBEATS.name(args.namespace), KV_EVENTS.name(args.namespace)
    nodes = [f"{args.prefix}{i:05d}" for i in range(args.nodes)]
    partition_of = await _partitions(producer, (hb_topic, kv_topic), nodes)
    epoch = f"{int(time.time() * 1000):013d}-bench"
    caches: dict[str, deque[int]] = {n: deque() for n in nodes}
    hb_seq = dict.fromkeys(nodes, 0)
    kv_seq = dict.fromkeys(nodes, 0)
    counter = 0
    sent = 0
    # validate the shapes once
    Heartbeat.model_validate(_hb(nodes[0], epoch, 0, time.time()))
    KvEventBatch.model_validate(_kv(nodes[0], epoch, 0, time.time(), [1], [], "snapshot"))
    for n in nodes:  # every node starts with a (empty) snapshot, as a real agent does
        await producer.send(
            kv_topic, orjson.dumps(_kv(n, epoch, 0, time.time(), [], [], "snapshot")), n.encode()
        )
    start = time.monotonic()
    tick = min(args.hb_interval_s, args.kv_interval_s)
    next_hb = start
    next_kv = start
    lag_max = 0.0
    while time.monotonic() - start < args.duration:
        now_m = time.monotonic()
        now = time.time()
        if now_m >= next_hb:
            lag_max = max(lag_max, now_m - next_hb)
            next_hb += args.hb_interval_s
            beats = []
            for n in nodes:
                hb_seq[n] += 1
                beats.append((n, orjson.dumps(_hb(n, epoch, hb_seq[n], now))))
            sent += await _send_round(producer, hb_topic, partition_of[hb_topic], beats)
        if now_m >= next_kv:
            lag_max = max(lag_max, now_m - next_kv)
            next_kv += args.kv_interval_s
            now_ms = int(now * 1000)
            batches = []
            for n in nodes:
                cache = caches[n]
                stored = []
                for _ in range(args.stored):
                    counter += 1
                    b = block_id(now_ms, counter)
                    stored.append(b)
                    cache.append(b)
                removed = [cache.popleft() for _ in range(max(0, len(cache) - args.cache_blocks))]
                kv_seq[n] += 1
                value = orjson.dumps(_kv(n, epoch, kv_seq[n], now, stored, removed, "delta"))
                batches.append((n, value))
            sent += await _send_round(producer, kv_topic, partition_of[kv_topic], batches)
        await asyncio.sleep(max(0.0, min(next_hb, next_kv) - time.monotonic(), tick / 50))
    await producer.flush()
    await producer.stop()
    elapsed = time.monotonic() - start
    return {
        "messages": sent,
        "elapsed_s": elapsed,
        "msgs_per_s": sent / elapsed,
        "producer_lag_max_s": lag_max,
    }


async def _partitions(
    producer: AIOKafkaProducer, topics: tuple[str, ...], nodes: list[str]
) -> dict[str, dict[str, int]]:
    """Per topic, the partition of each node's records (Kafka's default partitioner by key)."""
    out = {}
    for topic in topics:
        parts = sorted(await producer.partitions_for(topic))
        pick = DefaultPartitioner()
        out[topic] = {n: pick(n.encode(), parts, parts) for n in nodes}
    return out


async def _send_round(
    producer: AIOKafkaProducer,
    topic: str,
    partition_of: dict[str, int],
    records: list[tuple[str, bytes]],
) -> int:
    """Send ``records`` (node, value) as one record batch per partition (more when a batch
    fills); returns how many were sent."""
    batches: dict[int, Any] = {}
    for node, value in records:
        part = partition_of[node]
        batch = batches.get(part) or batches.setdefault(part, producer.create_batch())
        if batch.append(key=node.encode(), value=value, timestamp=None) is None:
            await producer.send_batch(batch, topic, partition=part)
            batch = batches[part] = producer.create_batch()
            batch.append(key=node.encode(), value=value, timestamp=None)
    for part, batch in batches.items():
        await producer.send_batch(batch, topic, partition=part)
    return len(records)


def _hb(node: str, epoch: str, seq: int, ts: float) -> dict[str, object]:
    return {
        "schema_version": 1,
        "node_id": node,
        "epoch": epoch,
        "seq": seq,
        "ts": ts,
        "endpoint": f"http://{node}:8000",
        "pool": "default",
        "model": "bench",
        "role": "mixed",
        "block_size": 16,
        "kv_blocks_total": 27000,
        "kv_blocks_used": seq % 27000,
        "running": seq % 17,
        "waiting": seq % 3,
        "healthy": True,
        "draining": False,
        "lease_s": 2.0,
    }


def _kv(
    node: str, epoch: str, seq: int, ts: float, stored: list[int], removed: list[int], kind: str
) -> dict[str, object]:
    return {
        "schema_version": 1,
        "node_id": node,
        "epoch": epoch,
        "seq": seq,
        "ts": ts,
        "kind": kind,
        "block_size": 16,
        "stored": stored,
        "removed": removed,
        "cleared": False,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bootstrap", default="127.0.0.1:19092")
    p.add_argument("--namespace", required=True)
    p.add_argument("--prefix", default="bn")
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--hb-interval-s", type=float, default=0.5)
    p.add_argument("--kv-interval-s", type=float, default=0.1)
    p.add_argument("--stored", type=int, default=4, help="blocks stored per KV batch")
    p.add_argument("--cache-blocks", type=int, default=400, help="blocks held per node")
    print(orjson.dumps(asyncio.run(run(p.parse_args()))).decode())


if __name__ == "__main__":
    main()
