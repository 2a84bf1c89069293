"""The router's background loops and its readiness.

* the lease sweep: the requests this router serves (its own and its endpoint picker's) keep
  their reservations renewed; flights whose owner did not end them in time are ended; leases
  that ran out expire with an event (router/flow/flight.py says who owns what);
* the degraded-feed prober: without a live feed the router asks the last-known engines
  itself (``GET /health``);
* the drain sweep: streams this router relays from a node that has been draining for
  ``router.drain_grace_s`` are ended there, to go on from another node (router/http/resume.py);
* the admission queue's pump;
* the tokenizer lookup: models the heartbeats name a source for get their tokenizer when this
  machine has it (router/flow/tokenizers.py).

A loop that fails goes on (with the next tick) and says so in :meth:`Loops.failing`, which
``/ready`` and the endpoint picker's readiness read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from admission.exceptions import AdmissionError
from admission.gate import AdmissionGate
from admission.reconciler import Reconciler
from router.control import ControlFollower
from router.feed import FeedWatch
from router.flow.external import ExternalRequests
from router.flow.flight import ROUTER, Flights
from router.flow.tokenizers import TokenizerDiscovery
from router.flow.views import ClusterView
from router.http.upstream import Upstream
from router.settings import RouterSettings
from streams.replica import TableReplica

__all__ = ["Loops"]

log = logging.getLogger(__name__)

TOKENIZER_LOOKUP_S = 2.0  # how often new (model, source) pairs are looked for
DRAIN_SWEEP_S = 0.5  # how often streams on draining nodes are looked for


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


class Loops:
    def __init__(
        self,
        settings: RouterSettings,
        router_id: str,
        gate: AdmissionGate,
        flights: Flights,
        external: ExternalRequests,
        views: ClusterView,
        upstream: Upstream,
    ) -> None:
        self.settings = settings
        self.router_id = router_id
        self.gate = gate
        self.flights = flights
        self.external = external
        self.views = views
        self.feed: FeedWatch = views.feed
        self.replica: TableReplica = views.replica
        self.upstream = upstream
        # the weights follower and the ledger reconciler, when the runtime has them
        self.control: ControlFollower | None = None
        self.reconciler: Reconciler | None = None
        self.tokenizers: TokenizerDiscovery | None = None  # models' tokenizers, looked up
        self._failing: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._pump: asyncio.Task[None] | None = None
        self._started_at = time.time()
        self._draining_since: dict[str, float] = {}  # node -> when this router saw it drain

    def start(self) -> None:
        self._pump = asyncio.create_task(self.gate.run_pump(time.time))
        self._tasks = [
            asyncio.create_task(self._sweep()),
            asyncio.create_task(self._probe()),
            asyncio.create_task(self._discover()),
            asyncio.create_task(self._drains()),
            self._pump,
        ]

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _probe(self) -> None:
        """Without a live feed, the router asks the last-known engines itself (``GET
        /health``): a node that does not answer leaves the candidate set until it does."""
        while True:
            await asyncio.sleep(self.settings.probe_interval_s)
            try:
                if self.upstream.open:
                    await self.feed.probe(self.upstream.session, time.time())
                self._failing.pop("prober", None)
            except Exception as exc:  # the loop goes on; /ready says so meanwhile
                self._failing["prober"] = _why(exc)
                log.exception("engine probes failed")

    async def _discover(self) -> None:
        """Look up the tokenizer of each model the heartbeats name a source for (once per
        source, in a thread: files and parsing), and use it once found."""
        while True:
            found = self.tokenizers
            try:
                for model, source in found.due(self.replica.load.values()) if found else ():
                    assert found is not None
                    tokenization = await asyncio.to_thread(found.look_up, model, source)
                    if tokenization is not None:
                        found.install(model, tokenization)
            except Exception:  # the loop goes on; the model stays approximate meanwhile
                log.exception("tokenizer lookup failed")
            await asyncio.sleep(TOKENIZER_LOOKUP_S)

    async def _drains(self) -> None:
        """Streams on a node draining for longer than its grace go on from another node."""
        while True:
            await asyncio.sleep(DRAIN_SWEEP_S)
            try:
                self.move_off_drained(time.time())
            except Exception:  # the loop goes on; the streams finish where they are
                log.exception("drain sweep failed")

    def move_off_drained(self, now: float) -> int:
        """End the engine streams of this router's requests on nodes draining for
        ``router.drain_grace_s`` (each goes on from another node); the number ended."""
        draining = {n.node_id for n in self.views.nodes(now) if n.draining}
        since = self._draining_since
        for node in list(since):
            if node not in draining:
                del since[node]
        for node in draining:
            since.setdefault(node, now)
        moved = 0
        for f in self.flights:
            if f.owner == ROUTER and f.cut is not None and f.node in draining:
                if now - since[f.node] >= self.settings.drain_grace_s:
                    cut, f.cut = f.cut, None
                    cut(f"node {f.node} drained")
                    moved += 1
        if moved:
            log.info("%d streams moved off draining nodes", moved)
        return moved

    async def _sweep(self) -> None:
        """The requests this router is serving keep their leases (renewed as they run out);
        leases that ran out (a release lost to a crash path) expire with an event."""
        while True:
            await asyncio.sleep(self.gate.settings.sweep_interval_s)
            now = time.time()
            try:
                for f in self.flights.expired(now):  # their owner did not end them in time
                    await self.external.finish(f.id, "cancelled", 0, None, None, None, expired=True)
                # this router's and its EPP's requests; a gateway renews its own
                # (/v1/kvgate/renew); a reservation no flight owns expires with its lease
                serving = [rid for rid in self.gate.held if self.flights.renews(rid)]
                await self.gate.renew(serving, now)
                await self.gate.sweep(now)
                self._failing.pop("sweeper", None)
            except AdmissionError as exc:
                log.warning("reservation sweep failed: %s", exc)
            except Exception as exc:  # the loop goes on; /ready says so meanwhile
                self._failing["sweeper"] = _why(exc)
                log.exception("reservation sweep failed")

    def failing(self) -> dict[str, str]:
        """Background loops that are down (restarting with backoff), and why."""
        out = dict(self._failing)
        parts: list[tuple[str, Any]] = [("replica", self.replica), ("control", self.control)]
        if self.reconciler is not None:
            parts += [("reconciler", self.reconciler), ("ledger", self.reconciler.ledger)]
        for name, part in parts:
            why = getattr(part, "failing", None)
            if why:
                out[name] = why
        if self._pump is not None and self._pump.done():
            out["queue_pump"] = "stopped"
        others = self.other_inproc_routers()
        if others:
            out["admission"] = (
                f"routers {sorted(others)[:5]} write the same ledger with in-process "
                "reservation stores: each admits against the whole budget (set "
                "admission.backend=redis)"
            )
        return out

    def other_inproc_routers(self) -> list[str]:
        """Other routers writing reservations to this ledger since this router started, while
        this one keeps its reservations in process (sole owner of the budget): together they
        would over-admit N-fold."""
        rec = self.reconciler
        if rec is None or not rec.sole_owner or not self.gate.settings.enabled:
            return []
        return [
            r
            for r, ts in rec.ledger.writers.items()
            if r != self.router_id and ts >= self._started_at
        ]

    def ready(self, now: float) -> bool:
        """Tables caught up, a healthy node, no background loop failing (the admission store
        is checked by ``/ready``)."""
        healthy = any(n.healthy and n.alive(now) for n in self.views.nodes(now))
        return self.replica.caught_up.is_set() and healthy and not self.failing()
