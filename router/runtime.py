"""The router's composition root: builds every part of a router process — the admission gate,
the pipeline's rules, the flow layer (router/flow/), the HTTP surfaces (router/http/), the
background loops — wires them, and returns them as a :class:`Router`. Nothing else constructs
them; nothing here decides anything."""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass

from admission.gate import AdmissionGate
from admission.reservations import ReservationStore
from admission.settings import AdmissionSettings
from admission.storm import StormStore
from router.decision.calibrate import TokenCalibration
from router.decision.candidates import budget_nodes
from router.decision.fleet import Fleet
from router.decision.hotprefix import HotPrefixes
from router.decision.inflight import InflightLedger
from router.decision.lanes import Lanes
from router.decision.pipeline import Refused, Routed, Rules, Snapshot
from router.decision.policies import LeastRequestsPolicy
from router.decision.policies.canary import WeightsCanary
from router.decision.recent import PendingPrefixes
from router.decision.types import Policy
from router.feed import FeedWatch
from router.flow.director import Director
from router.flow.entry import Entry
from router.flow.external import ExternalRequests
from router.flow.flight import Flights
from router.flow.intake import IntakeReader
from router.flow.preemption import Preemptions
from router.flow.proxied import ProxiedRequests
from router.flow.recorder import Recorder
from router.flow.sessions import SessionKeeper
from router.flow.tokenizers import TokenizerDiscovery
from router.flow.views import ClusterView
from router.flow.waiting import RouterQueue
from router.http.admin import AdminApi
from router.http.app import Routes, admin_routes, main_routes
from router.http.gateway import GatewayApi
from router.http.openai import OpenAiApi
from router.http.prefill import PrefillLeg
from router.http.probes import TokenChecks
from router.http.upstream import Upstream
from router.loops import Loops
from router.metrics import RouterMetrics
from router.settings import RouterSettings
from router.tokencheck import TokenCheck
from router.tracing import Tracing
from streams.kafka import KafkaBus
from streams.replica import TableReplica
from streams.topics import LEDGER

__all__ = ["Router", "build_router"]


@dataclass(slots=True)
class Router:
    """A router's parts, built and wired (no behaviour of its own). ``app`` and ``admin`` are
    its two listeners' routes; ``app``'s hooks start and stop the parts that run."""

    settings: RouterSettings
    router_id: str
    replica: TableReplica
    bus: KafkaBus
    policy: WeightsCanary  # the policy, and the candidate weights of a canary
    gate: AdmissionGate
    ledger: InflightLedger
    metrics: RouterMetrics
    tracing: Tracing
    flights: Flights
    director: Director
    entry: Entry
    external: ExternalRequests
    upstream: Upstream
    loops: Loops
    app: Routes
    admin: Routes


def _rules(settings: RouterSettings, policy: Policy, fleet: Fleet, gate: AdmissionGate) -> Rules:
    return Rules(
        policy,
        fleet,
        gate.settings,
        Lanes(settings.lanes, settings.cost.prefill_tokens_per_s),
        HotPrefixes(),
        prewarm=settings.prewarm,
        fallback=LeastRequestsPolicy(),
        disaggregation=settings.disaggregation,
        kv_bytes_per_token=settings.kv_bytes_per_token,
        kv_link_gbps=settings.kv_link_gbps,
        fit_hold_s=settings.fit_hold_s,
        fit_queue=settings.fit_overflow == "queue",
    )


def _lifecycle(
    app: Routes,
    upstream: Upstream,
    loops: Loops,
    tokens: TokenChecks,
    queue: RouterQueue[tuple[Routed | Refused, Snapshot]],
    tracing: Tracing,
) -> None:
    """What starts with the main listener and stops after it."""

    async def start() -> None:
        upstream.start()
        loops.start()

    async def stop() -> None:
        loops.stop()
        tokens.cancel()
        await queue.stop()
        await upstream.close()
        # the last spans leave before the process does (bounded by the exporter's timeout)
        await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)

    app.on_startup.append(start)
    app.on_cleanup.append(stop)


def build_router(
    settings: RouterSettings,
    replica: TableReplica,
    bus: KafkaBus,
    policy: Policy,
    admission: AdmissionSettings | None = None,
    store: ReservationStore | None = None,
    storm_store: StormStore | None = None,
    tracing: Tracing | None = None,
) -> Router:
    """Every part of a router over ``replica`` and ``bus`` (started by the caller: see
    deploy/routerproc.py); the admission store in process unless ``store`` is given, traces
    as ``router.otlp_endpoint`` says unless ``tracing`` is given."""
    s = settings
    router_id = s.router_id or f"{socket.gethostname()}:{s.port}:{os.getpid()}"
    canary = WeightsCanary(policy, s)
    ledger = InflightLedger(
        track_blocks=getattr(policy, "wants_active_blocks", False),
        pending=PendingPrefixes() if s.pending_prefixes else None,
    )
    if getattr(policy, "wants_sequences", False):  # a peer that counts its own requests
        policy.sequences = ledger  # type: ignore[attr-defined]
    queue: RouterQueue[tuple[Routed | Refused, Snapshot]] = RouterQueue(
        s.hold_poll_s, s.lanes.max_waiting
    )
    fleet = Fleet(s.outlier, s.slow_start)
    admission = admission or AdmissionSettings()
    unknown = set(s.objective_slo_classes.values()) - set(admission.slo_classes)
    if unknown:
        raise ValueError(
            f"router.objective_slo_classes names {sorted(unknown)}, not in admission.slo_classes"
        )
    gate = AdmissionGate(
        admission,
        router_id,
        lambda ev: bus.publish(LEDGER, ev.pool, ev),
        store,
        storm_store,
        # its own events rendered from their fields (streams/trusted.py), keyed by pool
        publish_json=lambda pool, raw: bus.post_json(LEDGER, pool, raw),
    )
    metrics = RouterMetrics()
    tracing = tracing or Tracing(s.otlp_endpoint, f"kvgate-router/{router_id}")
    flights = Flights()
    calibration = TokenCalibration()
    tokencheck = TokenCheck(s.tokenize_check_every, s.tokenize_check_min, s.tokenize_mismatch_share)
    feed = FeedWatch(s, replica)
    views = ClusterView(s, replica, fleet, feed, ledger)
    recorder = Recorder(s, bus, router_id, canary, views, metrics)
    reader = IntakeReader(s, gate, views, tokencheck, metrics, recorder)
    rules = _rules(s, canary, fleet, gate)
    director = Director(
        s, gate, views, rules, ledger, queue, metrics, recorder, reader, calibration
    )
    upstream = Upstream(s)
    tokens = TokenChecks(upstream, reader, tokencheck, metrics)
    sessions = SessionKeeper(s, canary)
    external = ExternalRequests(
        s, gate, director, flights, ledger, views, recorder, queue, calibration, tokens.check
    )
    external.sessions = sessions
    entry = Entry(reader, director, recorder, sessions)
    proxied = ProxiedRequests(
        s, gate, flights, ledger, views, queue, calibration, recorder, metrics, sessions
    )
    gate.preemptible = Preemptions(flights, gate, ledger, metrics)
    gate.capacity = lambda now: budget_nodes(views.nodes(now), now)
    loops = Loops(s, router_id, gate, flights, external, views, upstream)
    loops.tokenizers = TokenizerDiscovery(s, reader.tokenizations)
    prefill = PrefillLeg(s, upstream, gate, views, ledger, director, metrics)
    openai = OpenAiApi(s, entry, director, proxied, upstream, prefill, tokens, tracing, feed)
    gateway = GatewayApi(s, metrics, entry, external, gate, flights)
    admin = AdminApi(
        s, router_id, canary, director, reader, flights, tokencheck, loops, bus, sessions
    )
    app = main_routes(s, metrics, openai, gateway, admin)
    _lifecycle(app, upstream, loops, tokens, queue, tracing)
    return Router(
        s,
        router_id,
        replica,
        bus,
        canary,
        gate,
        ledger,
        metrics,
        tracing,
        flights,
        director,
        entry,
        external,
        upstream,
        loops,
        app,
        admin_routes(admin),
    )
