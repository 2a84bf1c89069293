"""Placement constraints: node labels (zone, GPU type, …) that a request or its tenant requires
or prefers, and the router's own zone.

* **require** — only nodes carrying every required label may serve the request; none: 503.
  The tenant's requirements always hold; a request may add its own
  (``X-Kvgate-Require-Labels: gpu=h100,zone=eu-1a``), never drop the tenant's.
* **prefer** — the nodes carrying every preferred label (the tenant's, the request's
  ``X-Kvgate-Prefer-Labels``, and else the router's own zone) are used while one of them has room
  (KV use below ``spill_kv_ratio`` and at most ``spill_queue`` requests waiting); when all of
  them are full, every candidate is.

Labels are short ``key=value`` pairs (Kubernetes-like syntax); at most :data:`MAX_LABELS` per
header. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.decision.types import NodeView
from streams.labels import KEY, VALUE

__all__ = [
    "FREE",
    "MAX_LABELS",
    "PREFER_HEADER",
    "REQUIRE_HEADER",
    "Placement",
    "parse_labels",
    "placement_of",
]

REQUIRE_HEADER = "X-Kvgate-Require-Labels"
PREFER_HEADER = "X-Kvgate-Prefer-Labels"
MAX_LABELS = 8
Labels = frozenset[tuple[str, str]]


def parse_labels(text: str) -> Labels:
    """``key=value,key=value`` → labels; raises ValueError with the reason."""
    out = set()
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if len(parts) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels")
    for part in parts:
        k, sep, v = part.partition("=")
        k, v = k.strip(), v.strip()
        if not sep or not KEY.match(k) or not VALUE.match(v):
            raise ValueError(f"a label is key=value, not {part[:80]!r}")
        out.add((k, v))
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class Placement:
    require: Labels = frozenset()
    prefer: Labels = frozenset()
    spill_kv_ratio: float = 0.85
    spill_queue: int = 4

    @property
    def free(self) -> bool:
        return not self.require and not self.prefer

    def allowed(self, nodes: Sequence[NodeView]) -> list[NodeView]:
        """The nodes that carry every required label."""
        if not self.require:
            return list(nodes)
        return [n for n in nodes if self.require <= n.labels]

    def preferred(self, nodes: Sequence[NodeView]) -> list[NodeView]:
        """The preferred nodes while one of them has room, else all of ``nodes``."""
        if not self.prefer:
            return list(nodes)
        mine = [n for n in nodes if self.prefer <= n.labels]
        if any(
            n.kv_used_ratio < self.spill_kv_ratio and n.queue_len <= self.spill_queue for n in mine
        ):
            return mine
        return list(nodes)

    def describe(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.require))


FREE = Placement()  # no constraint


def placement_of(
    headers: Mapping[str, str],
    tenant_require: Mapping[str, str],
    tenant_prefer: Mapping[str, str],
    zone: tuple[str, str] | None,
    spill_kv_ratio: float,
    spill_queue: int,
) -> Placement:
    """A request's placement: its tenant's labels plus the ones its headers add (ValueError on
    a malformed header); the router's zone is preferred when nothing else is."""
    require = frozenset(tenant_require.items()) | parse_labels(headers.get(REQUIRE_HEADER, ""))
    prefer = frozenset(tenant_prefer.items()) | parse_labels(headers.get(PREFER_HEADER, ""))
    if not prefer and zone is not None:
        prefer = frozenset({zone})
    return Placement(require, prefer, spill_kv_ratio, spill_queue)
