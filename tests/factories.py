"""Valid topic values for tests and benchmarks."""

from __future__ import annotations

import time
from typing import Any

from streams.schemas import Heartbeat


def heartbeat(
    node: str, seq: int = 0, epoch: str = "e", ts: float | None = None, **fields: Any
) -> Heartbeat:
    values: dict[str, Any] = {
        "endpoint": f"http://{node}",
        "model": "m",
        "block_size": 16,
        "kv_blocks_total": 100,
        "kv_blocks_used": 0,
        "running": 0,
        "waiting": 0,
    }
    values.update(fields)
    return Heartbeat(
        node_id=node, epoch=epoch, seq=seq, ts=time.time() if ts is None else ts, **values
    )
