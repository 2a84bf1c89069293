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
from dataclasses import dataclass, field, replace
from typing import Literal, cast

from admission.core import Rejection
from admission.settings import DEFAULT_SLO_CLASSES, AdmissionSettings
from agents.kvcache import AllCleared, BlockRemoved, BlockStored, CacheEvent
from agents.profile import EngineProfile
from agents.scheduler import DecodeRun
from analytics.autoscale import AutoscaleSettings, Observation, make_autoscaler
from analytics.sim.admission import Refused, SimAdmission
from analytics.sim.simcore import SimCore, SimSeq, SimStep
from analytics.sim.traces import Trace, TraceRequest
from router.decision.candidates import candidates
from router.decision.fleet import Fleet
from router.decision.holdqueue import UNKNOWN, HoldQueue
from router.decision.hotprefix import HotPrefixes, PrewarmAdvice
from router.decision.inflight import InflightLedger
from router.decision.lanes import Lanes
from router.decision.pipeline import Ask, Held, Routed, Rules, Snapshot, commit, decide
from router.decision.pipeline import Refused as NotRouted
from router.decision.placement import FREE, Placement
from router.decision.recent import RecentPrefills, merge_matches
from router.decision.types import NodeView, Policy, RouteRequest
from router.settings import LaneSettings, OutlierSettings, RouterSettings, SlowStartSettings
from streams.blocks import HASH_MASK
from streams.prefix_index import PrefixIndex

__all__ = ["Done", "FleetOp", "SimConfig", "node_profile", "simulate"]

MODEL = "sim"


@dataclass(frozen=True, slots=True)
class SimConfig:
    nodes: int = 16
    profile: EngineProfile = field(default_factory=EngineProfile)
    heartbeat_interval_s: float = 0.5
    index_lag_s: float = 0.15  # agent flush (100 ms) + Kafka + fold
    seed: int = 0
    fast_forward: bool = True  # steady decoding as one event per run (exact, see DecodeRun)
    # act on hot-prefix advice (router/decision/hotprefix.py) like the live agents
    prewarm: bool = False
    prewarm_delay_s: float = 0.2  # advice on kvgate.control → agent → engine
    admission: AdmissionSettings | None = None  # admission control in front of routing
    retries: RetryModel | None = None  # refused clients retry (None: a refusal is final)
    storm_guard: bool = False  # the retry-storm guard in front of admission
    # the router remembers its completed prefills (router/decision/recent.py)
    recent_prefill_ttl_s: float = 0.0
    node_ids: tuple[str, ...] = ()  # the nodes' names (default node-00, node-01, ...)
    # the live router's fleet rules (router/decision/fleet.py): outlier ejection, slow start, and
    # the operations on the fleet over time (drain, join, leave, canary)
    outlier: OutlierSettings = field(default_factory=lambda: OutlierSettings(enabled=False))
    slow_start: SlowStartSettings = field(default_factory=lambda: SlowStartSettings(window_s=0))
    ops: tuple[FleetOp, ...] = ()
    faults: tuple[tuple[str, float], ...] = ()  # (node, share of its requests answered with 500)
    fault_latency_s: float = 0.005  # how fast a broken engine answers
    node_labels: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()  # (node, labels)
    roles: tuple[tuple[str, str], ...] = ()  # (node, prefill | decode); others are mixed
    kv_link_gbps: float = 100.0  # KV transfer between engines (disaggregated prefill)
    disaggregation: bool = True  # split requests over prefill and decode nodes when both exist
    placement: Placement = FREE  # every request's required and preferred labels
    # the router's candidate cap (router.max_queue): nodes with more waiting are skipped
    max_queue: int = RouterSettings.model_fields["max_queue"].default
    lanes: LaneSettings | None = (
        None  # head-of-line isolation of long requests (router/decision/lanes.py)
    )
    # a closed-loop autoscaler (analytics/autoscale.py): ``nodes`` at the start, then what it
    # asks for; a new node serves after its lead time and starts cold
    autoscaler: AutoscaleSettings | None = None


@dataclass(frozen=True, slots=True)
class ScalePoint:
    """One autoscaler decision: the desired count, the nodes serving, the nodes paid for
    (serving, loading their model, or draining), the forecast rate (predictive)."""

    at_s: float
    desired: int
    serving: int
    provisioned: int
    arrivals_rps: float


@dataclass(frozen=True, slots=True)
class FleetOp:
    """An operation on the simulated fleet at ``at_s``: ``drain``/``undrain`` a node, ``join``
    (a node listed only here is absent until it joins, then starts cold, in slow start) or
    ``leave`` (no new requests; what runs there finishes), ``canary`` (``nodes`` take
    ``share`` of the requests; share 0 ends it), ``heal`` (its faults stop)."""

    at_s: float
    kind: Literal["drain", "undrain", "join", "leave", "canary", "heal"]
    node: str = ""
    nodes: tuple[str, ...] = ()
    share: float = 0.0


def node_names(cfg: SimConfig) -> list[str]:
    return list(cfg.node_ids) if cfg.node_ids else [f"node-{i:02d}" for i in range(cfg.nodes)]


@dataclass(frozen=True, slots=True)
class RetryModel:
    """How refused clients come back: after Retry-After, up to ``max_attempts``; the clients in
    ``storm_clients`` ignore it and retry after ``storm_delay_s``, up to ``storm_max_attempts``."""

    max_attempts: int = 4
    storm_clients: frozenset[str] = frozenset()
    storm_delay_s: float = 0.05
    storm_max_attempts: int = 40


@dataclass(slots=True)
class Done:
    """One finished request."""

    request: TraceRequest
    node: str
    reason: str
    hit_blocks_seen: int  # what the router believed the node had
    cached_tokens: int  # what the engine actually reused
    first_token_s: float
    finish_s: float
    queue_wait_s: float = 0.0  # time in the admission queue (included in TTFT)


@dataclass(slots=True)
class _Node:
    node_id: str
    core: SimCore
    busy: bool = False
    view: NodeView | None = None  # the last heartbeat the router has
    served: int = 0
    run: DecodeRun | None = None  # a fast-forwarded decode run in progress
    run_start: float = 0.0
    run_applied: int = 0
    gen: int = 0  # bumps when a scheduled run end is replaced
    finishing: list[SimSeq] = field(default_factory=list)  # finished, delivered at run end


def _view(
    n: _Node,
    now: float,
    lease_s: float,
    draining: bool = False,
    started_at: float | None = None,
    role: str = "mixed",
) -> NodeView:
    c = n.core
    return NodeView(
        node_id=n.node_id,
        endpoint=f"sim://{n.node_id}",
        model=MODEL,
        pool="default",
        block_size=c.profile.block_size,
        kv_blocks_total=c.cache.num_blocks,
        kv_blocks_used=c.cache.used_blocks,
        running=len(c.running),
        waiting=len(c.waiting),
        healthy=True,
        draining=draining,
        heartbeat_ts=now,
        lease_s=lease_s,
        started_at=started_at,
        role=role,
    )


def _all_hashes(r: TraceRequest, idx: int, block_size: int) -> list[int]:
    """The prompt's block hashes, then the blocks its answer fills: the trace's, or hashes of
    the request's own (cheap, distinct from every other request's)."""
    hashes = list(r.block_hashes) + list(r.output_block_hashes)
    total = (r.prompt_tokens + r.output_tokens) // block_size
    base = (idx + 1) << 24
    hashes += [((base + i) * 0x9E3779B97F4A7C15) & HASH_MASK for i in range(len(hashes), total)]
    return hashes


def fold(index: PrefixIndex, node_id: str, events: list[CacheEvent]) -> None:
    """Apply one node's cache events to the index, in order (consecutive stores as one)."""
    stored: list[int] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            stored += ev.block_hashes
            continue
        if stored:
            index.add_many(node_id, stored)
            stored = []
        if isinstance(ev, BlockRemoved):
            index.remove_many(node_id, ev.block_hashes)
        elif isinstance(ev, AllCleared):
            index.drop_node(node_id)
    if stored:
        index.add_many(node_id, stored)


def acting_on(cfg: SimConfig, router: RouterSettings) -> SimConfig:
    """``cfg`` with the kvgate system acting on the router's own advice: pre-warming hot
    prefixes and remembering its recent prefills (other policies have neither)."""
    if router.policy != "kvgate":
        return cfg
    return replace(cfg, prewarm=router.prewarm, recent_prefill_ttl_s=router.recent_prefill_ttl_s)


def node_profile(cfg: SimConfig, block_size: int) -> EngineProfile:
    """The engine profile at the trace's block size, keeping the profile's KV memory."""
    profile = (
        cfg.profile.model_copy(update={"block_size": block_size})
        if block_size != cfg.profile.block_size
        else cfg.profile
    )
    if block_size != cfg.profile.block_size and cfg.profile.num_gpu_blocks_override is None:
        profile = profile.model_copy(
            update={
                "num_gpu_blocks_override": max(
                    1, cfg.profile.num_gpu_blocks * cfg.profile.block_size // block_size
                )
            }
        )
    return profile


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
    stats = stats if stats is not None else {}
    policy.record_candidates = 0  # decisions are not logged here: only the chosen node counts
    stats.setdefault("prewarm_advice", 0)
    stats.setdefault("prewarm_requests", 0)
    hot = HotPrefixes() if cfg.prewarm else None
    recent = RecentPrefills(cfg.recent_prefill_ttl_s) if cfg.recent_prefill_ttl_s > 0 else None
    profile = node_profile(cfg, trace.block_size)
    initial = node_names(cfg)
    joining = sorted({op.node for op in cfg.ops if op.kind == "join"} - set(initial))
    scaler = make_autoscaler(cfg.autoscaler, cfg.nodes) if cfg.autoscaler is not None else None
    if scaler is not None:  # the pool it draws from: every node it may ever run at once
        spare = max(0, scaler.settings.max_replicas + 4 - len(initial))
        joining += [f"node-{i:02d}" for i in range(len(initial), len(initial) + spare)]
    nodes = [_Node(name, SimCore(profile)) for name in initial + joining]
    by_id = {n.node_id: n for n in nodes}
    fleet = Fleet(cfg.outlier, cfg.slow_start)
    present = set(initial)
    started: dict[str, float] = {}  # node -> when it joined (slow start)
    faults = dict(cfg.faults)
    labels = {node: frozenset(pairs) for node, pairs in cfg.node_labels}
    roles = dict(cfg.roles)
    # disaggregated requests between their prefill and decode legs: prefill seq id -> (the
    # request's index, its decode node, its decode seq, the prefill node's cached tokens)
    split: dict[str, tuple[int, str, SimSeq, int]] = {}
    prefill_reuse: dict[str, int] = {}  # decode seq id -> what the prefill node had cached
    slo_classes = cfg.admission.slo_classes if cfg.admission else DEFAULT_SLO_CLASSES
    holding: deque[tuple[int, float | None]] = deque()  # admitted, held back by their class
    lanes = (
        Lanes(cfg.lanes, profile.prefill_tokens_per_s)
        if cfg.lanes is not None and cfg.lanes.enabled
        else None
    )
    lane_queue: HoldQueue[tuple[int, float | None]] = HoldQueue()  # (request, admission wait)
    stats.setdefault("failed", 0)
    index = PrefixIndex()
    ledger = InflightLedger(track_blocks=getattr(policy, "wants_active_blocks", False))
    if getattr(policy, "wants_sequences", False):  # a peer that counts its own requests
        policy.sequences = ledger  # type: ignore[attr-defined]
    rules = Rules(
        policy,
        fleet,
        cfg.admission or AdmissionSettings(),
        lanes,
        hot,
        disaggregation=cfg.disaggregation,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        kv_link_gbps=cfg.kv_link_gbps,
    )
    rng = random.Random(cfg.seed)
    lease = cfg.heartbeat_interval_s * 4
    events: list[tuple[float, int, str, object]] = []
    tie = itertools.count()
    lagged: deque[tuple[float, str, list[CacheEvent]]] = deque()  # (visible at, node, events)
    meta: dict[str, tuple[TraceRequest, str, str, int]] = {}
    done: list[Done] = []
    refused = refused_out if refused_out is not None else []
    waited: dict[str, float] = {}
    adm = (
        SimAdmission(
            cfg.admission,
            kv_blocks_total=profile.num_gpu_blocks * cfg.nodes,
            node_blocks=profile.num_gpu_blocks,
            slots_total=cfg.admission.slots_per_node * cfg.nodes,
            block_size=trace.block_size,
            storm_guard=cfg.storm_guard,
        )
        if cfg.admission is not None
        else None
    )

    def push(t: float, kind: str, data: object) -> None:
        heapq.heappush(events, (t, next(tie), kind, data))

    t_start = trace.requests[0].arrival_s if trace.requests else 0.0
    push(t_start, "heartbeat", None)  # before the first arrival: routers start with a view
    for i, r in enumerate(trace.requests):
        push(r.arrival_s, "arrive", i)
    for op in cfg.ops:
        push(op.at_s, "op", op)
    # the autoscaler's state: nodes loading their model (join pending), nodes draining after
    # leaving, arrivals and refusals since its last decision, node time paid for
    loading: set[str] = set()
    leaving: set[str] = set()
    cancelled: set[str] = set()  # loads cancelled before they finished
    seen = {"arrivals": 0, "refused": 0, "paid": len(initial), "at": t_start}
    stats.setdefault("gpu_seconds", 0)
    if scaler is not None:
        push(t_start + scaler.settings.interval_s, "control", None)

    remaining = len(trace.requests)
    attempts: dict[int, int] = {}  # request -> its client's attempt now (the retry model's)

    def drain(n: _Node, now: float) -> None:
        evs = n.core.drain_events()
        if evs:
            lagged.append((now + cfg.index_lag_s, n.node_id, evs))

    def start_step(n: _Node, now: float) -> None:
        n.busy = True
        run = n.core.plan_decode_run() if cfg.fast_forward else None
        if run is not None:
            n.run, n.run_start, n.run_applied = run, now, 0
            push(now + run.elapsed(run.steps), "run", (n.node_id, n.gen))
            return
        res = n.core.step(now)
        drain(n, now)
        push(now + res.duration_s, "step", (n.node_id, res))

    def catch_up(n: _Node, now: float) -> None:
        """Apply ``n``'s decode run up to and including the step in progress at ``now`` — an
        engine applies a step when it starts it, and delivers its tokens when it ends."""
        run = n.run
        if run is None:
            return
        upto = min(run.steps, run.steps_done(now - n.run_start) + 1)
        if upto > n.run_applied:
            n.finishing += n.core.advance_decode(upto - n.run_applied)
            n.run_applied = upto
            drain(n, now)

    def cut_run(n: _Node, now: float) -> None:
        """A request arrives: the run stops after the step in progress."""
        run = n.run
        if run is None:
            return
        catch_up(n, now)
        if n.run_applied < run.steps:
            n.run = DecodeRun(n.run_applied, run.first_s, run.grow_s)
            n.gen += 1
            push(n.run_start + run.elapsed(n.run_applied), "run", (n.node_id, n.gen))

    def dispatch(
        idx: int, now: float, queue_wait_s: float | None, queued: bool = False
    ) -> str | None:
        """Route and send request ``idx`` as the live router does (its candidates, then
        router/decision/pipeline.py's decide and commit); None when sent (or refused), else
        what holds it back for now: its class (:data:`UNKNOWN`) or the lane rules (the queued
        best node) (``queued``: it is in the router's queue already)."""
        r = trace.requests[idx]
        rid = f"r{idx}"
        views = [
            n.view.with_router_state(
                *ledger.router_state(n.node_id, n.view.heartbeat_ts, now, MODEL)
            )
            for n in nodes
            if n.view is not None
        ]
        slo = (r.slo_class, slo_classes[r.slo_class]) if r.slo_class else None
        req = RouteRequest(
            rid,
            MODEL,
            r.block_hashes,
            r.prompt_tokens,
            r.output_tokens,
            r.session_id,
            slo[1].queue_weight if slo else 1.0,
        )
        matches = index.match(r.block_hashes)
        if recent is not None:
            matches = merge_matches(matches, recent.match(r.block_hashes, now))
        got = candidates(
            views,
            MODEL,
            now,
            cfg.max_queue,
            rules.admission.min_healthy_share,
            rules.admission.min_retry_after_s,
            cfg.placement,
        )
        if isinstance(got, Rejection):  # the router's 503 before admission's reservation
            turned_away(idx, got, now)
            return None
        ask = Ask(req, r.output_tokens, r.arrival_s, slo, hold_slo=adm is not None)
        snap = Snapshot(got, matches, now, trace.block_size, roles=bool(roles))
        d = decide(ask, snap, rules)
        if isinstance(d, Held):
            if d.why == "slo":
                if not queued:  # (one in the router's queue stays there)
                    holding.append((idx, queue_wait_s))  # waits until the engines drain
                return UNKNOWN
            if not queued:  # waits in the router's queue, short requests first
                long = isinstance(d.now, Routed) and d.now.facts.long
                lane_queue.push(lanes_key(r.arrival_s, long), long, (idx, queue_wait_s), d.blocker)
            return d.blocker
        if isinstance(d, NotRouted):
            turned_away(idx, d.rejection, now)
            return None
        # sent: the router's state learns from it (the hot-prefix counter sees every node)
        advice = commit(ask, replace(snap, nodes=views), d, rules, ledger)
        chosen = d.decision
        assert chosen.chosen is not None
        target = by_id[chosen.chosen]
        fault = faults.get(target.node_id)
        if fault and rng.random() < fault:  # a broken engine answers 500 at once
            push(now + cfg.fault_latency_s, "fail", (rid, target.node_id))
            return None
        seq = SimSeq(rid, r.prompt_tokens, r.output_tokens, _all_hashes(r, idx, trace.block_size))
        meta[rid] = (r, target.node_id, chosen.reason, matches.get(target.node_id, 0))
        if queue_wait_s is not None:
            waited[rid] = queue_wait_s
        if chosen.prefill is not None:  # the prompt is computed on the prefill node first
            pre = by_id[chosen.prefill]
            pid = f"{rid}/p"
            hit = matches.get(pre.node_id, 0) * trace.block_size
            ledger.dispatch(pid, pre.node_id, now, max(0, r.prompt_tokens - hit))
            split[pid] = (idx, target.node_id, seq, 0)
            add(pre, SimSeq(pid, r.prompt_tokens, 1, _all_hashes(r, idx, trace.block_size)), now)
        else:
            add(target, seq, now)
        if advice is not None:
            stats["prewarm_advice"] += 1
            push(now + cfg.prewarm_delay_s, "warm", (advice, r.block_hashes))
        return None

    def lanes_key(arrival_s: float, long: bool) -> float:
        return lanes.key(arrival_s, long) if lanes is not None else arrival_s

    def turned_away(idx: int, rej: Rejection, now: float) -> None:
        """The router refuses request ``idx`` (no candidates, no fit, its deadline): an
        admitted one gives its reservation back; the client retries as the retry model says."""
        r = trace.requests[idx]
        if adm is not None:  # (only admitted requests are routed)
            got = adm.refuse_admitted(idx, f"r{idx}", r.priority, rej, now)
        else:
            got = Refused(idx, r.priority, rej.reason, rej.retry_after_s, now)
        retry(r, idx, attempts.get(idx, 1), got, now)

    def release_held(now: float) -> None:
        """Held requests go in order while the engines have room (the first held again stops
        the round: the ones behind it would be too)."""
        for _ in range(len(holding)):
            idx, wait = holding.popleft()
            if dispatch(idx, now, wait) is not None:
                holding.appendleft(holding.pop())
                break
        if lane_queue:
            lane_queue.release(lambda item: dispatch(item[0], now, item[1], queued=True))

    def operate(op: FleetOp, now: float) -> None:
        if op.kind == "drain":
            fleet.drained.add(op.node)
        elif op.kind == "undrain":
            fleet.drained.discard(op.node)
        elif op.kind == "join":
            if op.node in loading:  # the autoscaler's node: loaded, it serves from now
                loading.discard(op.node)
            present.add(op.node)
            started[op.node] = now  # its view appears with the next heartbeat
        elif op.kind == "leave":
            present.discard(op.node)
            by_id[op.node].view = None
        elif op.kind == "canary":
            fleet.set_canary("canary", op.nodes, op.share)
        elif op.kind == "heal":
            faults.pop(op.node, None)
        if adm is not None:  # the budget follows the nodes that take requests
            serving = len(present - fleet.drained)
            adm.kv_blocks_total = profile.num_gpu_blocks * serving
            adm.slots_total = adm.settings.slots_per_node * serving

    def control(now: float) -> None:
        """One autoscaler decision: observe the pool, add cold nodes (serving after the lead
        time) or remove the least busy ones (they drain)."""
        assert scaler is not None
        s = scaler.settings
        for name in list(leaving):  # drained: no longer paid for
            if by_id[name].core.idle and not by_id[name].busy:
                leaving.discard(name)
        serving = sorted(present - fleet.drained)
        cores = [by_id[name].core for name in serving]
        obs = Observation(
            now=now,
            replicas=len(serving),
            arrivals=int(seen["arrivals"]),
            waiting=sum(len(c.waiting) for c in cores) + len(holding) + len(lane_queue),
            running=sum(len(c.running) for c in cores),
            kv_used=(
                sum(c.cache.used_blocks / c.cache.num_blocks for c in cores) / len(cores)
                if cores
                else 1.0
            ),
            refusals=len(refused) - int(seen["refused"]),
        )
        desired = scaler.observe(obs)
        have = len(present) + len(loading)
        if desired > have:
            idle = [
                n
                for n in nodes
                if n.node_id not in present
                and n.node_id not in loading
                and n.node_id not in leaving
                and n.core.idle
                and not n.busy
            ]
            for n in idle[: desired - have]:
                n.core = SimCore(profile)  # a new replica: an empty cache
                n.run, n.gen, n.finishing = None, n.gen + 1, []
                index.drop_node(n.node_id)
                loading.add(n.node_id)
                push(now + s.lead_time_s, "op", FleetOp(now + s.lead_time_s, "join", n.node_id))
        elif desired < have:
            for _ in range(have - desired):
                if loading:  # not serving yet: cancel the newest load
                    name = max(loading)
                    loading.discard(name)
                    cancelled.add(name)
                    continue
                if len(present) <= max(1, s.min_replicas):
                    break
                name = min(present, key=lambda x: len(by_id[x].core.running))
                operate(FleetOp(now, "leave", name), now)
                leaving.add(name)
        paid = len(present) + len(loading) + len(leaving)
        stats["gpu_seconds"] += round(seen["paid"] * (now - seen["at"]))
        seen.update(arrivals=0, refused=len(refused), paid=paid, at=now)
        if scale_out is not None:
            scale_out.append(
                ScalePoint(now, desired, len(present), paid, obs.arrivals / s.interval_s)
            )
        push(now + s.interval_s, "control", None)

    def refuse(got: Refused) -> None:
        nonlocal remaining
        refused.append(got)
        remaining -= 1

    def retry(r: TraceRequest, idx: int, attempt: int, got: Refused, now: float) -> None:
        """A refused client comes back (or gives up): the retry model decides when."""
        rm = cfg.retries
        storm = rm is not None and r.client in rm.storm_clients
        limit = 1 if rm is None else (rm.storm_max_attempts if storm else rm.max_attempts)
        if rm is None or attempt >= limit or not got.retry_after_s:
            refuse(replace(got, attempt=attempt))
            return
        refused.append(replace(got, attempt=attempt, final=False))
        delay = rm.storm_delay_s if storm else got.retry_after_s
        push(now + delay, "retry", (idx, attempt + 1))

    def pump(now: float) -> None:
        if adm is None:
            return
        admitted, gone = adm.pump(now)
        for g in gone:
            refuse(g)
        for idx, wait in admitted:
            dispatch(idx, now, wait)

    def add(n: _Node, seq: SimSeq, now: float) -> None:
        cut_run(n, now)
        n.core.add(seq)
        if not n.busy:
            start_step(n, now)

    def step_done(n: _Node, now: float, finished: list[SimSeq]) -> None:
        nonlocal remaining
        n.busy = False
        released = False
        for seq in finished:
            if seq.request_id in split:  # a prefill leg: its KV goes to the decode node
                idx, dnode, dseq, _ = split.pop(seq.request_id)
                ledger.finish(seq.request_id)
                r = trace.requests[idx]
                moved = r.prompt_tokens * profile.kv_bytes_per_token * 8 / (cfg.kv_link_gbps * 1e9)
                push(now + moved, "kv", (dnode, dseq, seq.cached_tokens))
                continue
            if seq.request_id not in meta:  # a warm-up request
                continue
            r, node, reason, seen = meta.pop(seq.request_id)
            ledger.finish(seq.request_id, now, seq.max_tokens)
            reused = prefill_reuse.pop(seq.request_id, None)
            fleet.detector.observe(node, None, now, len(present))
            if adm is not None:
                adm.release(seq.request_id, now)
                released = True
            n.served += 1
            done.append(
                Done(
                    r,
                    node,
                    reason,
                    seen,
                    seq.cached_tokens if reused is None else reused,
                    seq.first_token_s if seq.first_token_s is not None else now,
                    now,
                    waited.pop(seq.request_id, 0.0),
                )
            )
            remaining -= 1
        if released:
            pump(now)
        if (holding or lane_queue) and finished:
            release_held(now)
        if not n.core.idle:
            start_step(n, now)

    while events and (remaining > 0):
        now, _, kind, data = heapq.heappop(events)
        while lagged and lagged[0][0] <= now:
            fold(index, *lagged.popleft()[1:])
        if kind == "heartbeat":
            for n in nodes:
                catch_up(n, now)
                if n.node_id in present:
                    n.view = _view(
                        n,
                        now,
                        lease,
                        n.node_id in fleet.drained,
                        started.get(n.node_id),
                        roles.get(n.node_id, "mixed"),
                    )
                    if n.node_id in labels:
                        n.view = replace(n.view, labels=labels[n.node_id])
            pump(now)
            if holding or lane_queue:
                release_held(now)
            push(now + cfg.heartbeat_interval_s, "heartbeat", None)
        elif kind == "arrive" or kind == "retry":
            idx, attempt = (data, 1) if kind == "arrive" else cast(tuple[int, int], data)
            assert isinstance(idx, int)
            attempts[idx] = attempt
            if kind == "arrive":
                seen["arrivals"] += 1
            assert isinstance(idx, int)
            if adm is None:
                dispatch(idx, now, None)
            else:
                r = trace.requests[idx]
                key = f"a{idx}"  # the attempt's identity (an Idempotency-Key)
                got: bool | Refused | None = adm.early_retry(r.client, key, idx, r.priority, now)
                if got is None:
                    got = adm.arrive(
                        idx,
                        f"r{idx}",
                        r.priority,
                        r.prompt_tokens,
                        r.output_tokens,
                        now,
                        slo_classes[r.slo_class].ttft_s if r.slo_class else None,
                    )
                    if isinstance(got, Refused):
                        adm.remember(key, got, now, r.client)
                if got is True:
                    dispatch(idx, now, None)
                elif isinstance(got, Refused):
                    retry(r, idx, attempt, got, now)
        elif kind == "op":
            op = cast(FleetOp, data)
            if op.kind == "join" and op.node in cancelled:
                cancelled.discard(op.node)
                continue
            operate(op, now)
        elif kind == "control":
            control(now)
        elif kind == "kv":  # a prompt's KV arrived at its decode node: it decodes from there
            dnode, dseq, reused = cast(tuple[str, SimSeq, int], data)
            n = by_id[dnode]
            r = trace.requests[int(dseq.request_id[1:])]
            cut_run(n, now)
            n.core.receive(
                list(r.block_hashes)[: max(0, (r.prompt_tokens - 1) // trace.block_size)]
            )
            prefill_reuse[dseq.request_id] = reused  # the prefix cache's share: the prefill's
            add(n, dseq, now)
        elif kind == "fail":  # a broken engine's 500: the client sees it, the router counts it
            rid, node_id = cast(tuple[str, str], data)
            ledger.finish(rid)
            if fleet.detector.observe(node_id, "5xx", now, len(present)) is not None:
                stats["ejections"] = stats.get("ejections", 0) + 1
            stats["failed"] += 1
            remaining -= 1
            if adm is not None:
                adm.release(rid, now)
                pump(now)
        elif kind == "warm":  # an agent loads a hot prefix into its engine
            advice, hashes = cast(tuple[PrewarmAdvice, tuple[int, ...]], data)
            for node_id in advice.targets:
                stats["prewarm_requests"] += 1
                warm = SimSeq(
                    f"warm{stats['prewarm_requests']}",
                    advice.blocks * trace.block_size,
                    1,
                    list(hashes[: advice.blocks]),
                )
                add(by_id[node_id], warm, now)
        elif kind == "run":  # a decode run ends
            node_id, gen = cast(tuple[str, int], data)
            n = by_id[node_id]
            if gen != n.gen or n.run is None:
                continue  # replaced by a shorter run
            catch_up(n, now)
            n.run, finished, n.finishing = None, n.finishing, []
            step_done(n, now, finished)
        else:  # a step finished
            node_id, res = cast(tuple[str, SimStep], data)
            n = by_id[node_id]
            for seq in res.first:
                ledger.first_token(seq.request_id, now)
                if recent is not None and seq.request_id in meta:
                    # the prompt's blocks are in the node's cache from now on
                    recent.add(node_id, meta[seq.request_id][0].block_hashes, now)
            step_done(n, now, res.finished)
    if scaler is not None and trace.requests:  # the node time after the last decision
        end = max((d.finish_s for d in done), default=seen["at"])
        stats["gpu_seconds"] += round(seen["paid"] * max(0.0, end - seen["at"]))
    return done
