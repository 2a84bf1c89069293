"""How much KV a node can give one request: the figure agents publish and routers fall back to."""

from __future__ import annotations

import math

__all__ = ["admissible_blocks"]


def admissible_blocks(total: int, used: int, watermark: float) -> int:
    """Free plus evictable blocks (everything no running request references: a prefix cache
    evicts unreferenced blocks for new ones), minus the engine's watermark share of the total."""
    return max(0, total - used - math.ceil(watermark * total))
