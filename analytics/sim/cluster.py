"""A cluster of simulated engines in virtual time, routed by kvgate's routing core.

Each node is an :class:`analytics.sim.simcore.SimCore` — the live simulated engine's
:class:`agents.scheduler.EngineCore` scheduling, cache and timing, with decoding requests kept as a
group (step for step the same results, see ``tests/unit/test_simcore.py``). The router sees what
the live router would: heartbeats every ``heartbeat_interval_s`` and KV-cache changes
``index_lag_s`` late, plus its own dispatches that the heartbeats do not show yet
(:class:`router.decision.inflight.InflightLedger`). Every request is routed by a
:class:`router.decision.types.Policy`, the same objects the live router uses.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import cast

from admission.core import Rejection
from admission.settings import DEFAULT_SLO_CLASSES, AdmissionSettings
from agents.kvcache import CacheEvent
from analytics.autoscale import make_autoscaler
from analytics.sim.admission import Refused, SimAdmission
from analytics.sim.arrivals import ended, on_arrive, on_fail, pump, turned_away
from analytics.sim.enginesteps import catch_up, cut_run, on_run_ended, on_step, on_warm, start_step
from analytics.sim.fleetctl import control, operate
from analytics.sim.legs import leg_done, on_kv, send
from analytics.sim.preemption import SimPreemption
from analytics.sim.scaleroom import SimScaleRoom
from analytics.sim.simconfig import (
    MODEL,
    Done,
    FleetOp,
    ScalePoint,
    SimConfig,
    node_names,
    node_profile,
)
from analytics.sim.simcore import SimCore, SimSeq
from analytics.sim.simnode import SimNode, all_hashes, fold, node_view
from analytics.sim.simsessions import SimSessions
from analytics.sim.traces import Trace, TraceRequest
from router.decision.candidates import candidates
from router.decision.fleet import Fleet
from router.decision.holdqueue import UNKNOWN, HoldQueue
from router.decision.hotprefix import HotPrefixes
from router.decision.inflight import InflightLedger
from router.decision.lanes import Lanes
from router.decision.pipeline import Ask, Held, Routed, Rules, Snapshot, commit, decide
from router.decision.pipeline import Refused as NotRouted
from router.decision.recent import PendingPrefixes, RecentPrefills, known_matches
from router.decision.types import Policy, RouteRequest
from streams.prefix_index import PrefixIndex

__all__ = ["SimCluster", "simulate"]


class SimCluster:
    """One simulated cluster in virtual time: engines, the router's state (prefix index,
    in-flight ledger, fleet, lane rules, admission), the event heap, and one method per event
    kind. :func:`simulate` builds one and runs it."""

    def __init__(
        self,
        trace: Trace,
        policy: Policy,
        cfg: SimConfig,
        stats: dict[str, int] | None = None,
        refused_out: list[Refused] | None = None,
        scale_out: list[ScalePoint] | None = None,
    ) -> None:
        self.trace, self.policy, self.cfg = trace, policy, cfg
        self.refused_out, self.scale_out = refused_out, scale_out
        self.stats = stats if stats is not None else {}
        for counter in ("prewarm_advice", "prewarm_requests", "failed", "gpu_seconds"):
            self.stats.setdefault(counter, 0)
        self.profile = node_profile(cfg, trace.block_size)
        self._engines()
        self._router()
        self.rng = random.Random(cfg.seed)
        self.lease = cfg.heartbeat_interval_s * 4
        self.events: list[tuple[float, int, str, object]] = []
        self.tie = itertools.count()
        # KV events on their way to the index: (visible at, node, events)
        self.lagged: deque[tuple[float, str, list[CacheEvent]]] = deque()
        self.meta: dict[str, tuple[TraceRequest, str, str, int]] = {}
        self.done: list[Done] = []
        self.refused = refused_out if refused_out is not None else []
        self.waited: dict[str, float] = {}
        self.remaining = len(trace.requests)
        # the requests as sent: in closed loop a session's later turn gets the time it was sent
        self.requests: list[TraceRequest] = list(trace.requests)
        # request -> its client's attempt now (the retry model's)
        self.attempts: dict[int, int] = {}
        self.scale_room = SimScaleRoom(self)  # a model scaling up from zero: requests wait
        self._schedule()

    def _engines(self) -> None:
        """The engines: the initial nodes, the ones that join later, and the autoscaler's pool
        (every node it may ever run at once)."""
        cfg = self.cfg
        self.initial = node_names(cfg)
        self.joining = sorted({op.node for op in cfg.ops if op.kind == "join"} - set(self.initial))
        self.scaler = make_autoscaler(cfg.autoscaler, cfg.nodes) if cfg.autoscaler else None
        if self.scaler is not None:
            first = len(self.initial)
            spare = max(0, self.scaler.settings.max_replicas + 4 - first)
            self.joining += [f"node-{i:02d}" for i in range(first, first + spare)]
        self.nodes = [SimNode(name, SimCore(self.profile)) for name in self.initial + self.joining]
        self.by_id = {n.node_id: n for n in self.nodes}
        self.present = set(self.initial)
        self.started: dict[str, float] = {}  # node -> when it joined (slow start)
        self.faults = dict(cfg.faults)
        self.labels = {node: frozenset(pairs) for node, pairs in cfg.node_labels}
        self.roles = dict(cfg.roles)
        # requests between their two legs (analytics/sim/legs.py): first leg's seq id -> (the
        # request's index, the second leg's node, its seq, the blocks a pull brings; 0: P/D)
        self.split: dict[str, tuple[int, str, SimSeq, int]] = {}
        self.prefill_reuse: dict[str, int] = {}  # decode seq id -> what the prefill node cached
        # the autoscaler's state: nodes loading their model (join pending), nodes draining after
        # leaving, loads cancelled before they finished
        self.loading: set[str] = set()
        self.leaving: set[str] = set()
        self.cancelled: set[str] = set()

    def _router(self) -> None:
        """The router's state, as the live router keeps it: the prefix index, recent prefills,
        the in-flight ledger, the fleet, the lane rules and their queue, the SLO holds, the
        rules of router/decision/pipeline.py, and admission control."""
        cfg, policy, profile = self.cfg, self.policy, self.profile
        policy.record_candidates = 0  # decisions are not logged here: only the chosen node counts
        self.hot = HotPrefixes()
        self.sessions = SimSessions.of(cfg)  # retention hints (router.session_retention)
        ttl = cfg.recent_prefill_ttl_s
        self.recent = RecentPrefills(ttl) if ttl > 0 else None
        self.index = PrefixIndex()
        self.ledger = InflightLedger(
            track_blocks=getattr(policy, "wants_active_blocks", False),
            pending=PendingPrefixes() if cfg.pending_prefixes else None,
        )
        if getattr(policy, "wants_sequences", False):  # a peer that counts its own requests
            policy.sequences = self.ledger  # type: ignore[attr-defined]
        self.fleet = Fleet(cfg.outlier, cfg.slow_start)
        self.slo_classes = cfg.admission.slo_classes if cfg.admission else DEFAULT_SLO_CLASSES
        # admitted, held back by their class: (request, admission wait)
        self.holding: deque[tuple[int, float | None]] = deque()
        lanes = cfg.lanes
        self.lanes = (
            Lanes(lanes, profile.prefill_tokens_per_s)
            if lanes is not None and lanes.enabled
            else None
        )
        self.lane_queue: HoldQueue[tuple[int, float | None]] = HoldQueue()
        self.rules = Rules(
            policy,
            self.fleet,
            cfg.admission or AdmissionSettings(),
            self.lanes,
            self.hot,
            prewarm=cfg.prewarm,
            disaggregation=cfg.disaggregation,
            kv_bytes_per_token=profile.kv_bytes_per_token,
            kv_link_gbps=cfg.kv_link_gbps,
            fit_hold_s=cfg.fit_hold_s,
            fit_queue=cfg.fit_queue,
        )
        self.adm = (
            SimAdmission(
                cfg.admission,
                kv_blocks_total=profile.num_gpu_blocks * cfg.nodes,
                node_blocks=profile.num_gpu_blocks,
                slots_total=cfg.admission.slots_per_node * cfg.nodes,
                block_size=self.trace.block_size,
                storm_guard=cfg.storm_guard,
            )
            if cfg.admission is not None
            else None
        )
        self.preemption = SimPreemption(self)
        if self.adm is not None:
            self.adm.preemptible = self.preemption

    def _schedule(self) -> None:
        """The events known in advance: a heartbeat before the first arrival (routers start
        with a view), every arrival, the fleet operations, the autoscaler's first decision."""
        self.t_start = self.requests[0].arrival_s if self.trace.requests else 0.0
        self.push(self.t_start, "heartbeat", None)
        # closed loop: a session's later turn is sent when the turn before it ends, and a
        # session waiting for another when that one's last turn ends (arrivals.py)
        self.follower: dict[int, int] = {}
        last: dict[str, int] = {}
        for i, r in enumerate(self.trace.requests):
            after = r.session_id if r.after_session is None else r.after_session
            if self.trace.closed_loop and r.think_s is not None and after in last:
                self.follower[last[after]] = i
            else:
                self.push(r.arrival_s, "arrive", i)
            if r.session_id is not None:
                last[r.session_id] = i
        for op in self.cfg.ops:
            self.push(op.at_s, "op", op)
        # arrivals and refusals since the autoscaler's last decision, node time paid for
        self.seen = {"arrivals": 0, "refused": 0, "paid": len(self.initial), "at": self.t_start}
        if self.scaler is not None:
            self.push(self.t_start + self.scaler.settings.interval_s, "control", None)

    def push(self, t: float, kind: str, data: object) -> None:
        heapq.heappush(self.events, (t, next(self.tie), kind, data))

    def dispatch(
        self, idx: int, now: float, queue_wait_s: float | None, queued: bool = False
    ) -> str | None:
        """Route and send request ``idx`` as the live router does (its candidates, then
        router/decision/pipeline.py's decide and commit); None when sent (or refused), else
        what holds it back for now: its class (:data:`UNKNOWN`) or the lane rules (the queued
        best node) (``queued``: it is in the router's queue already)."""
        r = self.requests[idx]
        rid = f"r{idx}"
        reported = self.profile.prefill_tokens_per_s if self.cfg.prefill_probe else 0.0
        views = [
            self.ledger.view(n.view, n.view.heartbeat_ts, now, MODEL, reported)
            for n in self.nodes
            if n.view is not None
        ]
        slo = (r.slo_class, self.slo_classes[r.slo_class]) if r.slo_class else None
        req = RouteRequest(
            rid,
            MODEL,
            r.block_hashes,
            r.prompt_tokens,
            r.output_tokens,
            r.session_id,
            slo[1].queue_weight if slo else 1.0,
        )
        matches = self.index.match(r.block_hashes)
        matches = known_matches(matches, r.block_hashes, now, self.recent, self.ledger.pending)
        got = candidates(
            views,
            MODEL,
            now,
            self.cfg.max_queue,
            self.rules.admission.min_healthy_share,
            self.rules.admission.min_retry_after_s,
            self.cfg.placement,
        )
        if isinstance(got, Rejection):  # the router's 503 before admission's reservation
            turned_away(self, idx, got, now)
            return None
        adm = self.adm is not None
        ask = Ask(req, r.output_tokens, r.arrival_s, slo, hold_slo=adm, priority=r.priority)
        who = self.preemption if adm and self.preemption.sheddable else None
        bs = self.trace.block_size
        snap = Snapshot(got, matches, now, bs, roles=bool(self.roles), preemptible=who)
        d = decide(ask, snap, self.rules)
        if isinstance(d, Held):
            if d.why in ("slo", "fit"):
                if not queued:  # (one in the router's queue stays there)
                    self.holding.append((idx, queue_wait_s))  # waits until the engines drain
                return UNKNOWN
            if not queued:  # waits in the router's queue, short requests first
                assert self.lanes is not None  # only the lane rules hold a request here
                long = isinstance(d.now, Routed) and d.now.facts.long
                key = self.lanes.key(r.arrival_s, long)
                self.lane_queue.push(key, long, (idx, queue_wait_s), d.blocker)
            return d.blocker
        if isinstance(d, NotRouted):
            turned_away(self, idx, d.rejection, now)
            return None
        # sent: the router's state learns from it (the hot-prefix counter sees every node)
        advice = commit(ask, replace(snap, nodes=views), d, self.rules, self.ledger)
        chosen = d.decision
        assert chosen.chosen is not None
        target = self.by_id[chosen.chosen]
        fault = self.faults.get(target.node_id)
        if fault and self.rng.random() < fault:  # a broken engine answers 500 at once
            self.push(now + self.cfg.fault_latency_s, "fail", (rid, target.node_id))
            return None
        seq = SimSeq(
            rid, r.prompt_tokens, r.output_tokens, all_hashes(r, idx, self.trace.block_size)
        )
        if self.sessions is not None:  # the engine's retention hint
            seq.retain_s = self.sessions.hint_s(r.session_id, now)
        self.meta[rid] = (r, target.node_id, chosen.reason, matches.get(target.node_id, 0))
        if queue_wait_s is not None:
            self.waited[rid] = queue_wait_s
        send(self, idx, seq, chosen, matches, now)
        if advice is not None:
            self.stats["prewarm_advice"] += 1
            self.push(now + self.cfg.prewarm_delay_s, "warm", (advice, r.block_hashes))
        return None

    def release_held(self, now: float) -> None:
        """Held requests go in order while the engines have room (the first held again stops
        the round: the ones behind it would be too)."""
        for _ in range(len(self.holding)):
            idx, wait = self.holding.popleft()
            if self.dispatch(idx, now, wait) is not None:
                self.holding.appendleft(self.holding.pop())
                break
        if self.lane_queue:
            self.lane_queue.release(lambda item: self.dispatch(item[0], now, item[1], queued=True))

    def add(self, n: SimNode, seq: SimSeq, now: float, first: bool = False) -> None:
        cut_run(self, n, now)
        n.core.add(seq, first)
        if not n.busy:
            start_step(self, n, now)

    def step_done(self, n: SimNode, now: float, finished: list[SimSeq]) -> None:
        n.busy = False
        released = False
        for seq in finished:
            if leg_done(self, seq, now):  # a first leg: its KV goes to the second's node
                continue
            if seq.request_id not in self.meta:  # a warm-up request
                continue
            r, node, reason, hit = self.meta.pop(seq.request_id)
            self.preemption.ended(seq.request_id)
            self.ledger.finish(seq.request_id, now, seq.max_tokens)
            reused = self.prefill_reuse.pop(seq.request_id, None)
            self.fleet.detector.observe(node, None, now, len(self.present))
            if self.adm is not None:
                self.adm.release(seq.request_id, now)
                released = True
            n.served += 1
            self.done.append(
                Done(
                    r,
                    node,
                    reason,
                    hit,
                    seq.cached_tokens if reused is None else reused,
                    seq.first_token_s if seq.first_token_s is not None else now,
                    now,
                    self.waited.pop(seq.request_id, 0.0),
                )
            )
            self.remaining -= 1
            if self.sessions is not None:  # the session pauses: held on its node
                until = self.sessions.ended(r.session_id, now)
                if until is not None and r.session_id is not None:
                    self.policy.paused(r.session_id, node, now, until)
            ended(self, int(seq.request_id[1:]), now)
        if released:
            pump(self, now)
        if (self.holding or self.lane_queue) and finished:
            self.release_held(now)
        if not n.core.idle:
            start_step(self, n, now)

    def run(self) -> list[Done]:
        """Process events until every request finished or was refused; the finished ones."""
        handlers: dict[str, Callable[[float, object], None]] = {
            "heartbeat": self.on_heartbeat,
            "arrive": lambda now, data: on_arrive(self, now, data),
            "retry": lambda now, data: on_arrive(self, now, data, "retry"),
            "op": self.on_op,
            "control": lambda now, _: control(self, now),
            "kv": lambda now, data: on_kv(self, now, data),
            "fail": lambda now, data: on_fail(self, now, data),
            "warm": lambda now, data: on_warm(self, now, data),
            "run": lambda now, data: on_run_ended(self, now, data),
            "step": lambda now, data: on_step(self, now, data),
        }
        while self.events and (self.remaining > 0):
            now, _, kind, data = heapq.heappop(self.events)
            self.preemption.now = now
            while self.lagged and self.lagged[0][0] <= now:
                fold(self.index, *self.lagged.popleft()[1:])
            handlers[kind](now, data)
        if self.scaler is not None and self.trace.requests:  # the node time after the last decision
            end = max((d.finish_s for d in self.done), default=self.seen["at"])
            self.stats["gpu_seconds"] += round(self.seen["paid"] * max(0.0, end - self.seen["at"]))
        return self.done

    def on_heartbeat(self, now: float, data: object) -> None:
        """Every node's heartbeat: the router's views are renewed, held requests may go."""
        for n in self.nodes:
            catch_up(self, n, now)
            if n.node_id in self.present:
                n.view = node_view(
                    n,
                    now,
                    self.lease,
                    n.node_id in self.fleet.drained,
                    self.started.get(n.node_id),
                    self.roles.get(n.node_id, "mixed"),
                    self.cfg.kv_pull,
                )
                if n.node_id in self.labels:
                    n.view = replace(n.view, labels=self.labels[n.node_id])
        pump(self, now)
        self.scale_room.release(now)
        if self.holding or self.lane_queue:
            self.release_held(now)
        self.push(now + self.cfg.heartbeat_interval_s, "heartbeat", None)

    def on_op(self, now: float, data: object) -> None:
        """A fleet operation (drain, join, leave, canary, heal)."""
        op = cast(FleetOp, data)
        if op.kind == "join":
            self.scale_room.joins -= 1
        if op.kind == "join" and op.node in self.cancelled:
            self.cancelled.discard(op.node)
            return
        operate(self, op, now)


def simulate(
    trace: Trace,
    policy: Policy,
    cfg: SimConfig,
    stats: dict[str, int] | None = None,
    refused_out: list[Refused] | None = None,
    scale_out: list[ScalePoint] | None = None,
) -> list[Done]:
    """Replay ``trace`` through ``policy`` on ``cfg.nodes`` engines; returns finished requests.
    ``stats`` (if given) receives counters: pre-warm advice and warm-up requests. With
    ``cfg.admission``, requests pass admission control first; ``refused_out`` receives the
    refusals. With ``cfg.autoscaler``, ``scale_out`` receives its decisions and
    ``stats["gpu_seconds"]`` the node time paid for (from the decision to add a node, its model
    load included, until it has drained after the decision to remove it)."""
    return SimCluster(trace, policy, cfg, stats, refused_out, scale_out).run()
