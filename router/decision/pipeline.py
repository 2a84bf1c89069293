"""The one composition of the routing rules: :func:`decide` and :func:`commit`.

Every surface — the proxy, the gateway API, the endpoint picker, the dry run — and the
simulator route a request through :func:`decide`, in this order:

=====  ==============================  ==================================================
step   rule                            module
=====  ==============================  ==================================================
1      lane facts; the lane rules      router/decision/lanes.py (``proxy`` mode, not overdue)
2      fleet: drains, canary, slow     router/decision/fleet.py
       start, ejected nodes
3      fit: where the prompt's KV      router/decision/fit.py (``too_large``, ``no_fit_now``)
       fits now, and ever
4      policy (or roles: a P/D pair;   router/decision/policies/, router/decision/disagg.py
       or least requests on a
       degraded feed)
5      holds: the SLO class's, then    admission/slo.py, router/decision/lanes.py (``proxy``)
       the lane rules'
6      deadline: refused early when    admission/slo.py, admission/preempt.py
       its class's TTFT cannot be met
       (unless preempting sheddable
       work queued there saves it)
=====  ==============================  ==================================================

:func:`decide` never learns: a dry run, a poll of a held request and a decision that is not
taken change nothing. :func:`commit` applies what a routed request teaches, once, when it is
really sent: the policy's own state (session homes, averages), the fleet's outlier counts, the
lane rules' prefill mix, the in-flight ledger and hot-prefix counts. Time is always passed in.

Modes (NVIDIA Dynamo's query-only / tracked): ``query`` (a dry run: no holds, never
committed), ``gateway`` (a gateway or the endpoint picker forwards the request itself and waits
for the answer: no P/D split, no pull, no lane rules, no holds — it gets the best node now or a
refusal) and ``proxy`` (kvgate forwards it: every rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from admission.core import Rejection, RejectReason, retry_after
from admission.preempt import Preemptible, Running, deadline_victims, preempted
from admission.settings import AdmissionSettings, Priority
from admission.slo import Slo, expected_ttft_s, held, late_refusal
from router.decision.disagg import decide_roles
from router.decision.fit import fit, nearest
from router.decision.fleet import Fleet, Selection
from router.decision.holdqueue import UNKNOWN
from router.decision.hotprefix import HotPrefixes, PrewarmAdvice
from router.decision.inflight import InflightLedger
from router.decision.lanes import LaneFacts, Lanes, lane_facts, may_wait
from router.decision.policies.terms import prefill_rate, prefill_weight
from router.decision.types import Candidate, NodeView, Policy, RouteDecision, RouteRequest

__all__ = [
    "Ask",
    "Decision",
    "Held",
    "Mode",
    "Refused",
    "Routed",
    "Rules",
    "Snapshot",
    "commit",
    "decide",
    "no_node",
]

Mode = Literal["query", "gateway", "proxy"]


@dataclass(frozen=True, slots=True)
class Ask:
    """What is known of one request once it is admitted."""

    request: RouteRequest  # id, model, block hashes, prompt and max tokens, session, weight
    expected_output: int  # max_tokens capped by the tenant's learned answers
    arrived_s: float  # holds and the SLO deadline count from here
    slo: Slo | None = None  # its SLO class: the deadline, and the class's hold when admitted
    hold_slo: bool = False  # held for its class (admitted by admission control)
    mode: Mode = "proxy"
    prewarm: bool = True  # its prefix may be advised to other engines (not an adapter's)
    exact: bool = True  # its block hashes are of the engine's tokens (the index can match them)
    priority: Priority = "normal"  # whom it may preempt (admission/preempt.py)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The cluster as this router (or the simulator) sees it now, for one request."""

    nodes: Sequence[NodeView]  # the request's candidates (router/decision/candidates.py)
    matches: Mapping[str, int]  # prefix blocks per node: index, offload tier, recent, approx
    now: float
    block_size: int
    load_only: bool = False  # degraded feed: no hit claims, least requests
    fit_floor: int = 0  # prompts up to this many tokens fit on every node: no fit pass
    roles: bool = False  # some node has the prefill or decode role
    # who serves the sheddable requests not answered yet (admission/preempt.py): asked only of
    # a node that would make the request miss its class's TTFT; None: nobody is preempted
    preemptible: Preemptible | None = None


@dataclass(frozen=True, slots=True)
class Rules:
    """The router's decision components."""

    policy: Policy
    fleet: Fleet
    admission: AdmissionSettings  # deadline refusals, lease (hold limits), retry-after
    lanes: Lanes | None = None
    # prefixes' traffic shares (the cost of copying one) and pre-warm advice (``prewarm``)
    hot: HotPrefixes | None = None
    prewarm: bool = True
    fallback: Policy | None = None  # for a degraded feed (least requests)
    disaggregation: bool = True
    kv_bytes_per_token: int = 131_072
    kv_link_gbps: float = 100.0
    # proxy mode: a request whose KV fits on no node now waits up to this long (since it
    # arrived, at most half its lease) for one to have room, then is refused (0: at once)
    fit_hold_s: float = 0.0
    # past the hold: the engine's queue on the node nearest to room (False: 503 no_fit_now)
    fit_queue: bool = False


@dataclass(frozen=True, slots=True)
class Routed:
    decision: RouteDecision  # ``chosen`` is set
    facts: LaneFacts
    uncached_tokens: int  # prompt tokens the chosen node computes (0 for a P/D decode node)
    canary: str | None = None  # the fleet canary group the request fell in
    # to end before it is sent: the sheddable work that would make it miss its TTFT there
    preempt: tuple[Running, ...] = ()


@dataclass(frozen=True, slots=True)
class Refused:
    rejection: Rejection
    decision: RouteDecision  # ``chosen`` None; the reason (too_large, no_fit_now, deadline…)


@dataclass(frozen=True, slots=True)
class Held:
    """The request should wait in the router (the caller decides how): ``slo``, its class
    holds it while its best node is queued; ``lanes``, the lane rules do (``blocker``: its best
    node, or UNKNOWN); ``fit``, its KV fits on no node now (an engine would only queue it).
    ``now``: what it gets if it goes at once instead."""

    why: Literal["slo", "lanes", "fit"]
    blocker: str
    now: Routed | Refused


Decision = Routed | Held | Refused


def no_node(reason: str, prompt_tokens: int, s: AdmissionSettings) -> Rejection:
    """Why no node was chosen, as the client should hear it."""
    if reason == "too_large":
        msg = f"a prompt of {prompt_tokens} tokens fits in no engine's KV cache or context"
        return Rejection(RejectReason.TOO_LARGE, False, None, msg)
    if reason == "no_fit_now":
        msg = f"no engine has room for a prompt of {prompt_tokens} tokens now"
        return Rejection(RejectReason.NO_FIT_NOW, True, retry_after(1.0, s), msg)
    return Rejection(RejectReason.NO_CAPACITY, True, 1.0, "no healthy engine for this model")


def _refused(
    reason: str, ask: Ask, rules: Rules, candidates: tuple[Candidate, ...] = ()
) -> Refused:
    rej = no_node(reason, ask.request.prompt_tokens, rules.admission)
    return Refused(rej, RouteDecision(None, reason, candidates))


def _without_index_lag(nodes: Sequence[NodeView]) -> Sequence[NodeView]:
    """``nodes`` for a request of approximate tokens: what it matches comes from the router's
    memory of where it sent each prompt (the index holds the engines' tokens, which approximate
    ones do not match), so the index's lag says nothing about those hits and does not discount
    them (it did, on nodes with KV events only: working events routed worse than none).
    Limit: an engine that tokenizes as the router's approximation does (the simulated engine's
    default) lets the index match them too, and those index hits lose the lag discount here.
    The whole fix is for the policy's confidence to discount the index's share of a match only
    (for exact requests too: their recent and pending hits are the router's memory as well)."""
    if not any(n.kv_index_gap for n in nodes):
        return nodes
    return [replace(n, kv_index_gap=0, kv_index_age_s=0.0) if n.kv_index_gap else n for n in nodes]


def decide(ask: Ask, snap: Snapshot, rules: Rules) -> Decision:
    """Where ``ask`` goes now, or why it waits, or why it is refused; changes no state of
    ``rules`` that a later decision reads (see :func:`commit`)."""
    req, now = ask.request, snap.now
    matches: Mapping[str, int] = {} if snap.load_only else snap.matches
    waited = now - ask.arrived_s
    lanes = rules.lanes if rules.lanes is not None and rules.lanes.s.enabled else None
    cls = ask.slo[1] if ask.slo is not None else None
    lease_half = rules.admission.lease_s / 2
    lane_rules = (
        lanes is not None and ask.mode == "proxy" and waited < min(lanes.s.hold_max_s, lease_half)
    )
    facts = LaneFacts(ask.expected_output)
    nodes: Sequence[NodeView] = snap.nodes if ask.exact else _without_index_lag(snap.nodes)
    if lanes is not None:
        best_hit = max(matches.values(), default=0)
        uncached = max(0, req.prompt_tokens - best_hit * snap.block_size)
        facts = lane_facts(
            req.prompt_tokens, uncached, ask.expected_output, snap.block_size, lanes.s
        )
        if lane_rules:  # a request that may not wait uses every node rather than none
            nodes = lanes.select(nodes, facts, strict=may_wait(cls))
    sel = rules.fleet.select(nodes, req.session_id or req.request_id, now)
    if sel.nodes and req.prompt_tokens > snap.fit_floor:  # where its KV fits
        fitted = fit(sel.nodes, req.prompt_tokens, matches)
        if not fitted.ever:
            return _refused("too_large", ask, rules)
        if not fitted.nodes:
            refused = _refused("no_fit_now", ask, rules)
            if ask.mode != "proxy":
                return refused
            if waited < min(rules.fit_hold_s, lease_half):
                return Held("fit", UNKNOWN, refused)  # until a node has room
            if not rules.fit_queue:
                return refused
            # the engine queues it until its running requests free the room (as vLLM does):
            # later requests cannot take that room first, as they can from the router's hold
            sel = replace(sel, nodes=nearest(sel.nodes, req.prompt_tokens, matches))
        elif len(fitted.nodes) < len(sel.nodes):
            sel = replace(sel, nodes=fitted.nodes)
    d = _choose(ask, snap, rules, sel, matches)
    go = _go(ask, rules, d, facts, sel, matches, snap, waited)
    if ask.mode != "proxy":
        return go
    chosen = d.chosen_candidate
    if (
        ask.hold_slo
        and ask.slo is not None
        and chosen is not None
        and waited < min(ask.slo[1].ttft_s, lease_half)
        and held(ask.slo, chosen.components, req.queue_weight)
    ):
        return Held("slo", d.chosen or UNKNOWN, go)
    if lane_rules and lanes is not None and snap.nodes and may_wait(cls):
        best = next((n for n in sel.nodes if n.node_id == d.chosen), None)
        if lanes.hold(best):
            return Held("lanes", best.node_id if best is not None else UNKNOWN, go)
    return go


def _choose(
    ask: Ask, snap: Snapshot, rules: Rules, sel: Selection, matches: Mapping[str, int]
) -> RouteDecision:
    """The policy's decision among the selected nodes, marked ``ejected/`` when an ejection
    moved it."""
    now = snap.now
    req = _with_share(ask.request, rules, matches, now)
    givers = _givers(snap.nodes, sel.nodes, matches)
    if givers:
        req = replace(req, givers=givers)
    if snap.load_only and rules.fallback is not None:
        d = rules.fallback.decide(req, sel.nodes, {}, now)
    elif snap.roles:
        d = decide_roles(
            rules.policy,
            req,
            sel.nodes,
            matches,
            now,
            disaggregate=ask.mode == "proxy" and rules.disaggregation,
            kv_bytes_per_token=rules.kv_bytes_per_token,
            default_link_gbps=rules.kv_link_gbps,
        )
    else:
        d = rules.policy.decide(req, sel.nodes, matches, now)
    if d.pull is not None and ask.mode == "gateway":  # only the proxy runs a pull's two legs
        d = replace(d, reason="spread", pull=None, pull_blocks=0)
    if d.chosen is None:
        return d
    reason = rules.fleet.reason(d.reason, d.chosen, sel, matches)
    return d if reason == d.reason else replace(d, reason=reason)


def _givers(
    nodes: Sequence[NodeView], candidates: Sequence[NodeView], matches: Mapping[str, int]
) -> tuple[NodeView, ...]:
    """The healthy nodes that can give KV and hold more of the prompt than every candidate
    but are not candidates themselves (no room for it, or past their limits): a pull may read
    its prefix from them (router/decision/pull.py) — a node too full to run a request can still
    hand over what it holds."""
    if not matches or len(candidates) == len(nodes):  # candidates are a subset of nodes
        return ()
    best = max((matches.get(n.node_id, 0) for n in candidates), default=0)
    held = {node for node, got in matches.items() if got > best}
    if not held:
        return ()
    held -= {n.node_id for n in candidates}
    return tuple(n for n in nodes if n.node_id in held and n.kv_pull and n.healthy)


def _with_share(
    req: RouteRequest, rules: Rules, matches: Mapping[str, int], now: float
) -> RouteRequest:
    """``req`` with the traffic share of its longest held prefix (what a copy of it is worth)."""
    if rules.hot is None or not matches:
        return req
    share = rules.hot.prefix_share(req.block_hashes, matches, now)
    return replace(req, prefix_share=share) if share else req


def _go(
    ask: Ask,
    rules: Rules,
    d: RouteDecision,
    facts: LaneFacts,
    sel: Selection,
    matches: Mapping[str, int],
    snap: Snapshot,
    waited: float,
) -> Routed | Refused:
    """The request sent at once: no node (refused), past its class's deadline (refused, or
    routed with the sheddable work that makes it late there to preempt), or routed."""
    if d.chosen is None:
        return _refused(d.reason, ask, rules, d.candidates)
    chosen = d.chosen_candidate
    components = chosen.components if chosen is not None else None
    late = late_refusal(
        ask.slo,
        components,
        prefill_weight(rules.policy),
        ask.request.queue_weight,
        waited,
        rules.admission,
    )
    victims: tuple[Running, ...] = ()
    if late is not None and components is not None:
        victims = _making_time(ask, rules, components, sel, d.chosen, snap, waited)
        if not victims:  # refused early: it would miss its class's TTFT
            return Refused(late, RouteDecision(None, "deadline", d.candidates))
    # a decode node of a split request computes none of the prompt: its KV arrives
    hit = matches.get(d.chosen, 0)
    block_size = snap.block_size
    held = max(hit, d.pull_blocks)  # a pull brings the prefix's KV, the node computes the rest
    uncached = 0 if d.prefill is not None else max(0, ask.request.prompt_tokens - held * block_size)
    return Routed(d, facts, uncached, sel.canary, victims)


def _making_time(
    ask: Ask,
    rules: Rules,
    components: Mapping[str, float],
    sel: Selection,
    chosen: str,
    snap: Snapshot,
    waited: float,
) -> tuple[Running, ...]:
    """The sheddable work on ``chosen`` to preempt so that ``ask`` meets its class's TTFT
    there (admission/preempt.py :func:`deadline_victims`); none when there is none to ask
    for, or it would not be enough."""
    if snap.preemptible is None or ask.slo is None:
        return ()
    ttft = expected_ttft_s(components, prefill_weight(rules.policy), ask.request.queue_weight)
    node = next((n for n in sel.nodes if n.node_id == chosen), None)
    if ttft is None or node is None:
        return ()
    late_s = waited + ttft - ask.slo[1].ttft_s
    rate = prefill_rate(rules.policy, node)
    running = snap.preemptible.on_node(chosen)
    return tuple(deadline_victims(ask.priority, late_s, rate, running, rules.admission))


def commit(
    ask: Ask, snap: Snapshot, routed: Routed, rules: Rules, inflight: InflightLedger
) -> PrewarmAdvice | None:
    """``routed`` is sent (``proxy`` and ``gateway`` modes; never a dry run): the sheddable
    work it was routed past is preempted (its clients may come back once such a request could
    have started), the fleet counts it (a probing node's probe), the policy learns from it,
    the lane rules count its prefill, the in-flight ledger holds it from now on, and the
    hot-prefix counter sees it (advice to pre-warm other engines with its prefix, when it is
    hot)."""
    d, now, req = routed.decision, snap.now, ask.request
    assert d.chosen is not None
    if routed.preempt and snap.preemptible is not None:
        wait = ask.slo[1].ttft_s if ask.slo is not None else 0.0
        rej = preempted(ask.priority, wait, rules.admission)
        for r in routed.preempt:
            snap.preemptible.preempt(r.request_id, rej)
    rules.fleet.detector.sent(d.chosen, now)
    rules.policy.commit(req, d, routed.uncached_tokens, now)
    if rules.lanes is not None:
        rules.lanes.observe(routed.uncached_tokens, routed.facts.long_prompt, now)
    inflight.dispatch(
        req.request_id,
        d.chosen,
        now,
        routed.uncached_tokens,
        routed.facts.expected_output,
        routed.facts.blocks,
        req.block_hashes,
    )
    if rules.hot is None or snap.load_only:
        return None
    advise = rules.prewarm and ask.prewarm
    return rules.hot.observe(now, req.block_hashes, snap.matches, snap.nodes, advise)
