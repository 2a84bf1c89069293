"""A deterministic stream of heartbeats and KV batches, and the state it must produce.

The expected state is computed here independently of ``streams.folds``: per node, batches at or
below the last applied (epoch, seq) are ignored; a snapshot replaces the node's blocks, ``cleared``
empties them, a delta removes then stores.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from pydantic import BaseModel

from streams.schemas import Heartbeat, KvEventBatch


@dataclass
class Expected:
    blocks: dict[str, set[int]] = field(default_factory=dict)
    last_heartbeat: dict[str, tuple[str, int]] = field(default_factory=dict)


def _hb(node: str, epoch: str, seq: int, ts: float) -> Heartbeat:
    return Heartbeat(
        node_id=node,
        epoch=epoch,
        seq=seq,
        ts=ts,
        endpoint=f"http://{node}",
        model="m",
        block_size=16,
        kv_blocks_total=5000,
        kv_blocks_used=seq % 5000,
        running=seq % 7,
        waiting=seq % 3,
    )


def synthetic_stream(nodes: int = 4, steps: int = 1600, seed: int = 11) -> list[BaseModel]:
    rng = random.Random(seed)
    out: list[BaseModel] = []
    names = [f"node-{i}" for i in range(nodes)]
    epoch = {n: "0001-a" for n in names}
    kv_seq = dict.fromkeys(names, 0)
    hb_seq = dict.fromkeys(names, 0)
    held: dict[str, set[int]] = {n: set() for n in names}
    ts = time.time()
    next_hash = 1
    for n in names:
        out.append(
            KvEventBatch(
                node_id=n, epoch=epoch[n], seq=0, ts=ts, kind="snapshot", block_size=16, stored=[]
            )
        )
    restarted = False
    for step in range(steps):
        ts += 0.01
        n = rng.choice(names)
        if not restarted and step == steps // 2:  # node-0's agent restarts: new epoch, snapshot
            restarted, n = True, names[0]
            epoch[n], kv_seq[n] = "0002-b", 0
            keep = set(rng.sample(sorted(held[n]), len(held[n]) // 2))
            held[n] = keep
            out.append(
                KvEventBatch(
                    node_id=n,
                    epoch=epoch[n],
                    seq=0,
                    ts=ts,
                    kind="snapshot",
                    block_size=16,
                    stored=sorted(keep),
                )
            )
            continue
        r = rng.random()
        if r < 0.35:
            hb_seq[n] += 1
            out.append(_hb(n, epoch[n], hb_seq[n], ts))
            continue
        kv_seq[n] += 1
        if r < 0.37:  # a full snapshot that drops some blocks and adds others
            keep = {h for h in held[n] if rng.random() < 0.8}
            for _ in range(rng.randint(1, 10)):
                keep.add(next_hash)
                next_hash += 1
            held[n] = keep
            out.append(
                KvEventBatch(
                    node_id=n,
                    epoch=epoch[n],
                    seq=kv_seq[n],
                    ts=ts,
                    kind="snapshot",
                    block_size=16,
                    stored=sorted(keep),
                )
            )
        elif r < 0.38:  # the engine cleared its cache, then stored a little
            fresh = list(range(next_hash, next_hash + 3))
            next_hash += 3
            held[n] = set(fresh)
            out.append(
                KvEventBatch(
                    node_id=n,
                    epoch=epoch[n],
                    seq=kv_seq[n],
                    ts=ts,
                    block_size=16,
                    cleared=True,
                    stored=fresh,
                )
            )
        else:
            removed = rng.sample(sorted(held[n]), min(len(held[n]), rng.randint(0, 12)))
            stored = list(range(next_hash, next_hash + rng.randint(0, 30)))
            next_hash += len(stored)
            held[n] = (held[n] - set(removed)) | set(stored)
            b = KvEventBatch(
                node_id=n,
                epoch=epoch[n],
                seq=kv_seq[n],
                ts=ts,
                block_size=16,
                stored=stored,
                removed=removed,
            )
            out.append(b)
            if rng.random() < 0.05:  # a producer retry re-sends the same batch
                out.append(b)
    for n in names:  # a closing heartbeat per node marks the end of the stream
        hb_seq[n] += 1
        out.append(_hb(n, epoch[n], hb_seq[n], ts + 1))
    return out


def expected_state(stream: list[BaseModel]) -> Expected:
    exp = Expected()
    applied: dict[str, tuple[str, int]] = {}
    for msg in stream:
        if isinstance(msg, Heartbeat):
            key = (msg.epoch, msg.seq)
            if msg.node_id not in exp.last_heartbeat or key > exp.last_heartbeat[msg.node_id]:
                exp.last_heartbeat[msg.node_id] = key
            continue
        assert isinstance(msg, KvEventBatch)
        key = (msg.epoch, msg.seq)
        if msg.node_id in applied and key <= applied[msg.node_id]:
            continue
        applied[msg.node_id] = key
        blocks = exp.blocks.setdefault(msg.node_id, set())
        if msg.kind == "snapshot" or msg.cleared:
            blocks.clear()
        blocks.difference_update(msg.removed)
        blocks.update(msg.stored)
    return exp
