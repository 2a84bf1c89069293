"""The waiting room of a model scaling up from zero (router/decision/scaleup.py says when a
model is scaling and how long it takes).

A proxied request for a model with no ready node waits here while one is on its way, at most
``router.scale_wait_s`` (and never past its SLO class's TTFT), and goes on to admission the
moment a node is ready. A gateway's or the endpoint picker's request is never held (the gateway
waits for its answer itself): it is refused at once. A refusal is 503 ``scaling`` with a
Retry-After of the learned scale-up time left. While requests wait,
``kvgate_router_scale_waiting`` says how many (a KEDA activation trigger can read it: the pool
scales from zero on the first request, not on the autoscaler's next interval).
"""

from __future__ import annotations

import asyncio
import time

from admission.core import Rejection, RejectReason
from router.decision.scaleup import ScaleUps, ready, scaling
from router.decision.types import NodeView
from router.flow.refusals import Refusal
from router.flow.views import ClusterView
from router.metrics import RouterMetrics
from router.settings import RouterSettings

__all__ = ["ScaleRoom"]

POLL_S = 0.1  # how often a waiting request looks for a ready node
MAX_SEEN = 100_000  # nodes remembered as once ready


class ScaleRoom:
    def __init__(
        self, settings: RouterSettings, views: ClusterView, metrics: RouterMetrics
    ) -> None:
        self.settings = settings
        self.views = views
        self.metrics = metrics
        self.ups = ScaleUps(settings.scale_up_s)
        self.desired: dict[str, int] = {}  # model -> replicas an autoscaler asked for
        self.seen_ready: set[str] = set()  # nodes seen ready (failing later: not starting)
        self.waiting = 0

    def known(self, model: str) -> bool:
        """A model served at zero replicas: listed, or asked for by an autoscaler."""
        return model in self.settings.models_at_zero or model in self.desired

    def scale(self, model: str, desired: int) -> None:
        """An autoscaler's ``scale`` message for ``model`` (at most ``MAX_SEEN`` models kept)."""
        if model in self.desired or len(self.desired) < MAX_SEEN:
            self.desired[model] = desired

    async def wait(
        self, model: str, max_wait_s: float, hold: bool, nodes: list[NodeView], now: float
    ) -> bool:
        """Return once ``model`` has a ready node (at once, False, when ``nodes`` — the cluster
        at ``now`` — has one or none is coming; True after a wait: the caller reads the cluster
        again); raise a 503 ``scaling`` :class:`Refusal` when none is ready within
        ``max_wait_s`` (or at once with ``hold`` False)."""
        if ready(nodes, model, now):
            self.ups.warm(model, now)
            if len(self.seen_ready) < MAX_SEEN:
                self.seen_ready.update(n.node_id for n in nodes if n.healthy)
            return False
        at_zero = self.settings.models_at_zero
        if not scaling(nodes, model, now, at_zero, self.desired, self.seen_ready):
            return False  # nothing is coming: admission and routing say why
        self.ups.cold(model, now)
        limit = min(max_wait_s, self.settings.scale_wait_s) if hold else 0.0
        start = now
        self.waiting += 1
        self.metrics.scale_waiting.set(self.waiting)
        try:
            while now - start < limit:
                await asyncio.sleep(min(POLL_S, limit - (now - start)))
                now = time.time()
                if ready(self.views.nodes(now), model, now):
                    self.ups.warm(model, now)
                    self.metrics.scale_wait.labels("served").observe(now - start)
                    return True
        finally:
            self.waiting -= 1
            self.metrics.scale_waiting.set(self.waiting)
        self.metrics.scale_wait.labels("refused").observe(now - start)
        self.metrics.rejected(RejectReason.SCALING)
        after = self.ups.retry_after_s(model, now)
        raise Refusal.of(
            Rejection(
                RejectReason.SCALING,
                True,
                after,
                f"no node of `{model[:200]}` is ready yet; one is starting (expected in "
                f"{after:.0f} s)",
            )
        )
