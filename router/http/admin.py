"""The admin and probe endpoints: ``POST /v1/kvgate/decide`` (a dry run), ``GET
/v1/kvgate/state`` (the cluster as this router sees it), ``/metrics``, ``/health`` and
``/ready``. The two ``/v1/kvgate`` ones need an admin key on the main listener
(router/http/app.py) and nothing on the admin listener."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any
from urllib.parse import parse_qs

import orjson
from pydantic import ValidationError

from admission.exceptions import AdmissionError
from admission.failover import FailoverReservations
from admission.queue import ORDER as PRIORITIES
from admission.settings import Tenant
from router.decision.candidates import budget_totals
from router.decision.policies.canary import WeightsCanary
from router.decision.types import NodeView
from router.flow.director import Director
from router.flow.flight import Flights
from router.flow.intake import IntakeReader
from router.flow.refusals import Refusal
from router.flow.salt import isolated
from router.flow.sessions import SessionKeeper
from router.gauges import collect
from router.http.edge import json_answer
from router.loops import Loops
from router.settings import RouterSettings
from router.tokencheck import TokenCheck
from router.wire.server import Reply, Request
from streams.agentapis import agent_api
from streams.kafka import KafkaBus
from streams.schemas import Heartbeat

__all__ = ["AdminApi"]

# what agents report of their engine's KV events, per node in /v1/kvgate/state
_COUNTERS = (
    "engine_restarts",
    "kv_events_lost",
    "kv_events_undecodable",
    "kv_blocks_untranslatable",
    "kv_blocks_skipped",
)


def _agent_counters(hb: Heartbeat | None) -> dict[str, int]:
    return {name: getattr(hb, name) if hb is not None else 0 for name in _COUNTERS}


class AdminApi:
    def __init__(
        self,
        settings: RouterSettings,
        router_id: str,
        policy: WeightsCanary,
        director: Director,
        reader: IntakeReader,
        flights: Flights,
        tokencheck: TokenCheck,
        loops: Loops,
        bus: KafkaBus,
        sessions: SessionKeeper | None = None,
    ) -> None:
        self.settings = settings
        self.router_id = router_id
        self.policy = policy
        self.director = director
        self.reader = reader
        self.flights = flights
        self.tokencheck = tokencheck
        self.loops = loops
        self.bus = bus
        self.sessions = sessions
        d = director
        self.gate, self.views, self.replica, self.ledger = d.gate, d.views, d.replica, d.ledger

    def _tenant(self, name: str | None) -> Tenant:
        """The configured tenant called ``name`` (None: the anonymous one); a 400 if none is."""
        known = [*self.gate.settings.tenants.values(), self.gate.settings.anonymous]
        found = next((t for t in known if t.name == (name or known[-1].name)), None)
        if found is None:
            raise Refusal(400, f"no tenant is called {name!r}")
        return found

    async def decide(self, request: Request, reply: Reply) -> None:
        """Dry run: what would the router do with this body (completion or chat)? No events,
        no pre-warm advice, no reservation. An admin endpoint: it shows what the index holds.
        ``?tenant=NAME`` decides as that tenant's request (its cache group's salt), where tenants'
        caches are kept apart; ``?api=messages`` or ``?api=responses``: the body is one of the
        agent APIs' (streams/agentapis.py)."""
        raw = request.body
        query = parse_qs(request.query)
        named = query.get("api", [None])[0]
        api = None if named is None else agent_api(f"/v1/{named}")
        if named is not None and api is None:
            raise Refusal(400, "api is messages or responses (else: chat or completion by body)")
        try:
            body = orjson.loads(raw)
            chat = api is not None or (isinstance(body, dict) and "messages" in body)
            p = self.reader.parse(raw, chat, api)
        except (orjson.JSONDecodeError, ValidationError, ValueError) as exc:
            raise Refusal(400, str(exc).splitlines()[0]) from None
        if self.reader.isolating:  # as the named tenant's request (default: an anonymous one)
            p = isolated(p, self._tenant(query.get("tenant", [None])[0]))
        t0 = time.perf_counter()
        rreq, d, nodes, block_size = await self.director.dry_run(p, time.time())
        decision_us = (time.perf_counter() - t0) * 1e6
        endpoint = next((n.endpoint for n in nodes if n.node_id == d.chosen), None)
        json_answer(
            reply,
            {
                "chosen_node": d.chosen,
                "endpoint": endpoint,
                "reason": d.reason,
                "pull_node": d.pull,
                "pull_blocks": d.pull_blocks,
                "prompt_tokens": rreq.prompt_tokens,
                "prompt_blocks": len(rreq.block_hashes),
                "block_size": block_size,
                "decision_us": decision_us,
                "policy": self.policy.name,
                "weights_version": self.policy.weights_version,
                "candidates": [
                    {
                        "node_id": c.node_id,
                        "score": c.score,
                        "hit_blocks": c.hit_blocks,
                        "kv_used_ratio": c.kv_used_ratio,
                        "queue_len": c.queue_len,
                        "components": c.components,
                    }
                    for c in d.candidates
                ],
            },
        )

    async def _budgets(self, views: list[NodeView], now: float) -> dict[str, Any]:
        """Reservations, reserved blocks and each budget's use (None: the store is
        unreachable)."""
        store = self.gate.store
        budgets: dict[str, dict[str, Any]] = {}
        try:
            reservations: int | None = await store.count()
            for key, total in budget_totals(views, now).items():
                blocks, slots, _drain = await store.snapshot(key, now)
                budgets[key] = {
                    "kv_blocks_total": total,
                    "reserved_kv_blocks": blocks,
                    "reserved_slots": slots,
                    "used_ratio": round(blocks / total, 4) if total else None,
                    "queued": self.gate.queues.depth(key),
                }
            reserved: int | None = sum(b["reserved_kv_blocks"] for b in budgets.values())
        except AdmissionError:
            reservations = reserved = None  # the store is unreachable
        queued: Counter[str] = Counter({p: 0 for p in PRIORITIES})
        for key in self.gate.queues.pools():
            queued.update(self.gate.queues.depth(key))
        return {
            "reservations": reservations,
            "reserved_kv_blocks": reserved,
            "budgets": budgets,
            "queued": dict(queued),
        }

    def _node(self, n: NodeView, now: float) -> dict[str, Any]:
        hb = self.replica.load.get(n.node_id)
        return {
            "model": n.model,
            "pool": n.pool,
            "role": n.role,
            "labels": dict(sorted(n.labels)),
            "started_at": n.started_at,
            "endpoint": n.endpoint,
            "alive": n.alive(now),
            "healthy": n.healthy,
            "running": n.running,
            "waiting": n.waiting,
            "pending": n.pending,
            "remaining_decode_tokens": n.decode_backlog_tokens,
            "prefill_backlog_tokens": n.prefill_backlog_tokens,
            # the rate its prompts are costed at (its model's mean), its own as this router
            # learned it, and as its agent measured it (agents/probe.py)
            "prefill_tokens_per_s": round(n.prefill_tokens_per_s, 1) or None,
            "observed_prefill_tokens_per_s": round(self.ledger.node_prefill_rate(n.node_id), 1)
            or None,
            "reported_prefill_tokens_per_s": hb.prefill_tokens_per_s if hb is not None else None,
            "long_kv_blocks": n.long_kv_blocks,
            "kv_used_ratio": n.kv_used_ratio,
            "heartbeat_age_s": now - n.heartbeat_ts,
            "indexed_blocks": len(self.replica.index.blocks_view(n.node_id)),
            "kv_index": hb.kv_index if hb is not None else None,
            **_agent_counters(hb),
        }

    async def state(self, _: Request, reply: Reply) -> None:
        """The replica as this router sees it: nodes, their load and indexed blocks."""
        now = time.time()
        views = self.views.nodes(now)
        d, control, rec = self.director, self.loops.control, self.loops.reconciler
        lanes = d.rules.lanes
        json_answer(
            reply,
            {
                "router_id": self.router_id,
                "policy": self.policy.name,
                "weights_version": self.policy.weights_version,
                "weights_canary": self.policy.state(),
                "weights_refused": control.refused if control else 0,
                # control messages refused for their signature or age (streams/controlauth.py)
                "control": {
                    "authenticated": control.auth.enabled,
                    "refused": dict(control.refusals),
                }
                if control
                else None,
                **d.fleet.state(now),
                "token_calibration": d.calibration.report(),
                "tokenization_checks": self.tokencheck.report(),
                "tokenizers": t.report() if (t := self.loops.tokenizers) is not None else {},
                "replica_caught_up": self.replica.caught_up.is_set(),
                "indexed_blocks": len(self.replica.index),
                **await self._budgets(views, now),
                "inflight": len(self.ledger),
                "sessions": s.report(now) if (s := self.sessions) is not None else None,
                "lanes": {
                    "enabled": lanes.s.enabled if lanes is not None else False,
                    "queue": len(d.queue),
                    "long_prefill_share": round(lanes.long_share(), 4)
                    if lanes is not None
                    else 0.0,
                    "lane": sorted(lanes.lane(views)) if lanes is not None else [],
                },
                "reconciler": (
                    rec.report(self.replica.load.values(), now) if rec is not None else None
                ),
                "nodes": {n.node_id: self._node(n, now) for n in views},
            },
        )

    async def health(self, _: Request, reply: Reply) -> None:
        json_answer(reply, {"status": "ok", "router_id": self.router_id})

    async def ready(self, _: Request, reply: Reply) -> None:
        now = time.time()
        healthy = [n.node_id for n in self.views.nodes(now) if n.healthy and n.alive(now)]
        store_ready, store = True, self.gate.store
        # the shared store away, admission goes on within this router's share: still ready
        failover = store if isinstance(store, FailoverReservations) else None
        local = failover is not None and failover.degraded
        if self.gate.settings.enabled and not local:
            try:  # an empty Redis admits nothing until the reconciler rebuilt it
                store_ready = await store.generation() is not None
            except AdmissionError:
                store_ready = False
            local = failover is not None and failover.degraded  # it just found the store away
        failing = self.loops.failing()
        caught_up = self.replica.caught_up.is_set()
        ready = caught_up and bool(healthy) and (store_ready or local) and not failing
        json_answer(
            reply,
            {
                "ready": ready,
                "failing": failing,
                # degraded routers stay ready: they serve on what they know (router/feed.py)
                "feed": self.director.feed.state,
                "kafka_queued": self.bus.queued,
                "kafka_refused": sum(self.bus.refused.values()),  # never taken: set aside
                "replica_caught_up": caught_up,
                "admission_store_ready": store_ready,
                "admission_store_share": failover.down_share if failover and local else None,
                "admission_store": (
                    "off"
                    if not self.gate.settings.enabled
                    else "local_share"
                    if local
                    else "shared"
                    if store_ready
                    else "down"
                ),
                "healthy_nodes": len(healthy),
                "indexed_blocks": len(self.replica.index),
            },
            200 if ready else 503,
        )

    async def metrics(self, _: Request, reply: Reply) -> None:
        now = time.time()
        m = self.director.metrics
        await collect(
            m,
            self.views.nodes(now),
            list(self.replica.load.values()),
            self.director.fleet,
            self.gate,
            self.bus,
            self.director.feed.state,
            self.flights.by_priority(),
            now,
        )
        reply.send(200, m.render(), "text/plain; charset=utf-8")
