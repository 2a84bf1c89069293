"""A model with no ready node, about to have one: whether a request waits for it, and for how long
its client should be told to wait (pure; the live router's waiting room, router/flow/scaleroom.py,
and the simulator call these).

A model is *scaling* when it has no ready node (healthy, alive, not draining) and one is on its
way: a node registered that is not ready yet (its agent beats, its engine does not answer
healthy, and it was never seen ready: a pod starting — a node that served and then failed is a
failure, answered at once as before), an autoscaler that asked for replicas (a ``scale``
control message with ``desired_replicas`` > 0), or the model listed in
``router.models_at_zero`` (a pool that scales to zero: its autoscaler wakes it on demand). Such
a request waits, bounded by its deadline, and is released when a node is ready; past its
deadline it is refused 503 ``scaling`` with a Retry-After from the scale-up time learned from
past starts (:class:`ScaleUps`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from router.decision.types import NodeView

__all__ = ["ScaleUps", "ready", "scaling"]


def ready(nodes: Iterable[NodeView], model: str, now: float) -> bool:
    """Whether a node that serves ``model`` is ready for it now."""
    return any(n.serves(model) and n.healthy and not n.draining and n.alive(now) for n in nodes)


def scaling(
    nodes: Iterable[NodeView],
    model: str,
    now: float,
    at_zero: Iterable[str] = (),
    desired: Mapping[str, int] | None = None,
    seen_ready: Collection[str] = (),
) -> bool:
    """Whether ``model`` (no node ready for it) is expected to get one: a node of it starting
    (not healthy, never in ``seen_ready``), an autoscaler's ``desired`` replicas, or
    ``at_zero`` listing it."""
    if model in at_zero or (desired or {}).get(model, 0) > 0:
        return True
    return any(
        n.serves(model) and not n.healthy and n.alive(now) and n.node_id not in seen_ready
        for n in nodes
    )


@dataclass(slots=True)
class ScaleUps:
    """How long a model takes from cold (a request waiting, or a node seen starting) to a ready
    node, learned per model (exponentially weighted: recent starts count most)."""

    default_s: float = 60.0  # before any start was seen
    weight: float = 0.3
    learned: dict[str, float] = field(default_factory=dict)
    cold_since: dict[str, float] = field(default_factory=dict)  # models cold now, since when

    def cold(self, model: str, now: float) -> None:
        """``model`` has no ready node at ``now`` (the first call starts its cold period)."""
        self.cold_since.setdefault(model, now)

    def warm(self, model: str, now: float) -> float | None:
        """A node of ``model`` is ready at ``now``: the cold period it ends (seconds) is learned
        and returned (None: it was not cold)."""
        since = self.cold_since.pop(model, None)
        if since is None:
            return None
        took = max(0.0, now - since)
        old = self.learned.get(model)
        self.learned[model] = took if old is None else old + self.weight * (took - old)
        return took

    def expected_s(self, model: str) -> float:
        return self.learned.get(model, self.default_s)

    def retry_after_s(self, model: str, now: float) -> float:
        """How long until ``model`` is expected to have a ready node (at least 1 s)."""
        since = self.cold_since.get(model, now)
        return max(1.0, self.expected_s(model) - (now - since))
