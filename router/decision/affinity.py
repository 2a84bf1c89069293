"""Hash rings for placement without shared state: plain consistent hashing and consistent
hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded
Loads", 2017) for soft session affinity.

A session's home is the first node clockwise from the session's point whose load is at most
``c`` × the mean load (+1, so that an idle cluster still has room). Every router replica computes
the same ring from the same node set, so the home needs no shared state; after the first turn,
the prefix index itself draws the session back to the node holding its context.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterable, Mapping

__all__ = ["HashRing", "point"]


def point(key: str) -> int:
    """A key's position on the ring."""
    return zlib.crc32(key.encode())


class HashRing:
    def __init__(self, vnodes: int = 64, c: float = 1.25) -> None:
        self.vnodes = vnodes
        self.c = c
        self._rings: dict[frozenset[str], tuple[list[int], list[str]]] = {}

    def _ring(self, ids: frozenset[str]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(ids)
        if ring is None:
            points = sorted(
                (point(f"{node}#{v}"), node) for node in ids for v in range(self.vnodes)
            )
            ring = ([p for p, _ in points], [n for _, n in points])
            if len(self._rings) > 64:  # node sets change rarely; keep a few
                self._rings.clear()
            self._rings[ids] = ring
        return ring

    def owner(self, at: int, nodes: Iterable[str]) -> str | None:
        """The plain consistent-hash owner of ring position ``at``."""
        points, owners = self._ring(frozenset(nodes))
        if not points:
            return None
        return owners[bisect.bisect(points, at) % len(points)]

    def home(self, at: int, loads: Mapping[str, float]) -> str | None:
        """The owner of ``at`` among ``loads``' nodes, skipping nodes over the load bound."""
        if not loads:
            return None
        points, owners = self._ring(frozenset(loads))
        bound = self.c * (sum(loads.values()) / len(loads)) + 1.0
        start = bisect.bisect(points, at)
        skipped: set[str] = set()
        for i in range(len(points)):
            node = owners[(start + i) % len(points)]
            if node in skipped:
                continue
            if loads[node] <= bound:
                return node
            skipped.add(node)
            if len(skipped) == len(loads):
                break
        return min(loads, key=lambda n: loads[n])
