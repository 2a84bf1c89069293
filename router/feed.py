"""Whether the router's heartbeat feed is live, and what it does when it is not.

``live``; ``last_known`` once no heartbeat from any node arrived for ``feed_stale_s`` (Kafka is
away, not every node at once: the router routes on its last view, leaving out nodes that fail
its probes); ``load_only`` after ``degraded_view_s`` more (the view is too old to trust: its own
in-flight count over the probed nodes). While degraded, the router probes every last-known
engine's ``GET /health``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import aiohttp

from router.settings import RouterSettings
from streams.replica import TableReplica

__all__ = ["FeedState", "FeedWatch"]

log = logging.getLogger(__name__)

FeedState = Literal["live", "last_known", "load_only"]


class FeedWatch:
    def __init__(self, settings: RouterSettings, replica: TableReplica) -> None:
        self.settings = settings
        self.replica = replica
        self.state: FeedState = "live"
        self.down: set[str] = set()  # nodes that failed a probe (or a connection) while degraded

    def state_at(self, now: float) -> FeedState:
        rx = self.replica.last_heartbeat_rx
        if rx is None or not self.replica.load:
            return "live"
        silent = now - rx - self.settings.feed_stale_s
        if silent <= 0:
            return "live"
        return "last_known" if silent <= self.settings.degraded_view_s else "load_only"

    def update(self, now: float) -> FeedState:
        """The state now; a change is logged, and returning to live forgets the probes."""
        state = self.state_at(now)
        if state != self.state:
            log.warning(
                "feed %s -> %s (newest heartbeat %.1f s ago)",
                self.state,
                state,
                now - (self.replica.last_heartbeat_rx or now),
            )
            self.state = state
            if state == "live":
                self.down.clear()
        return state

    async def probe(self, http: aiohttp.ClientSession, now: float) -> None:
        """While degraded: ask every last-known engine whether it is up."""
        if self.update(now) == "live":
            return
        beats = list(self.replica.load.values())
        timeout = aiohttp.ClientTimeout(total=min(2.0, self.settings.probe_interval_s))

        async def up(endpoint: str) -> bool:
            try:
                async with http.get(endpoint.rstrip("/") + "/health", timeout=timeout) as r:
                    return r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                return False

        results = await asyncio.gather(*(up(hb.endpoint) for hb in beats))
        for hb, ok in zip(beats, results, strict=True):
            if ok:
                self.down.discard(hb.node_id)
            else:
                self.down.add(hb.node_id)
