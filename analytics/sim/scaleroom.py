"""The waiting room of a model scaling up from zero, in the simulator: the live router's rule
(router/decision/scaleup.py, router/flow/scaleroom.py) on a :class:`SimCluster`.

A request arriving while no node is ready and one is on its way (a ``join`` still to come, a
node the autoscaler is loading) waits — before admission, as live — at most
``cfg.scale_wait_s`` and never past its class's TTFT; every heartbeat releases the waiting ones
once a node is ready, and refuses (503 ``scaling``, Retry-After from the learned start time)
those past their bound."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from admission.core import RejectReason
from analytics.sim.admission import Refused
from analytics.sim.simconfig import MODEL
from router.decision.scaleup import ScaleUps, ready, scaling

if TYPE_CHECKING:
    from analytics.sim.cluster import SimCluster

__all__ = ["SimScaleRoom"]


class SimScaleRoom:
    def __init__(self, sim: SimCluster) -> None:
        self.sim = sim
        self.ups = ScaleUps(sim.cfg.scale_up_s)
        self.joins = sum(1 for op in sim.cfg.ops if op.kind == "join")  # still to come
        self.waiting: deque[tuple[int, int, float]] = deque()  # (request, attempt, since)
        self.waited: dict[int, float] = {}  # request -> how long it waited (stats)

    def _state(self, now: float) -> tuple[bool, bool]:
        sim = self.sim
        views = [n.view for n in sim.nodes if n.view is not None]
        if ready(views, MODEL, now):
            self.ups.warm(MODEL, now)
            return True, False
        coming = self.joins + len(sim.loading)
        return False, scaling(views, MODEL, now, desired={MODEL: coming})

    def holds(self, idx: int, attempt: int, now: float) -> bool:
        """Whether request ``idx`` waits here (or was refused here) instead of going on."""
        is_ready, coming = self._state(now)
        if is_ready or not coming:
            return False
        self.ups.cold(MODEL, now)
        self.waiting.append((idx, attempt, now))
        if self._bound(idx) <= 0:
            self.release(now)
        return True

    def _bound(self, idx: int) -> float:
        sim = self.sim
        r = sim.requests[idx]
        ttft = sim.slo_classes[r.slo_class].ttft_s if r.slo_class else sim.cfg.scale_wait_s
        return min(sim.cfg.scale_wait_s, ttft)

    def release(self, now: float) -> None:
        """The waiting requests go on once a node is ready; those past their bound are
        refused."""
        if not self.waiting:
            return
        from analytics.sim.arrivals import on_arrive, retry

        sim = self.sim
        is_ready, _ = self._state(now)
        for _ in range(len(self.waiting)):
            idx, attempt, since = self.waiting.popleft()
            if is_ready:
                self.waited[idx] = now - since
                on_arrive(sim, now, (idx, attempt), "scaled")
            elif now - since >= self._bound(idx):
                after = self.ups.retry_after_s(MODEL, now)
                r = sim.requests[idx]
                got = Refused(idx, r.priority, RejectReason.SCALING, after, now)
                retry(sim, r, idx, attempt, got, now)
            else:
                self.waiting.append((idx, attempt, since))
