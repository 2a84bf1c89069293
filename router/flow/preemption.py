"""This router's side of preemption (admission/preempt.py): the proxied streams of sheddable
priority that have not produced their first token, and ending one of them for a request of a
higher class that would otherwise miss its deadline — in the admission queue (the gate asks)
or on its best node (routing names them, router/decision/pipeline.py's commit ends them).

A flight can be preempted while ``Flight.preempt`` is set: the proxy sets it while such a
request's engine works on it and no byte has reached the client (router/http/preemptible.py), so
the client hears one clean 503 ``preempted`` with Retry-After — never half an answer. Only
streams are preempted: a non-streamed answer's first token cannot be seen. Requests routed for
a gateway or by the endpoint picker are the gateway's to end, not this router's."""

from __future__ import annotations

from admission.core import Rejection
from admission.gate import AdmissionGate
from admission.preempt import Running
from router.decision.inflight import InflightLedger
from router.flow.flight import Flights
from router.metrics import RouterMetrics

__all__ = ["Preemptions"]


class Preemptions:
    """:class:`admission.preempt.Preemptible` over this router's flights."""

    def __init__(
        self, flights: Flights, gate: AdmissionGate, ledger: InflightLedger, metrics: RouterMetrics
    ) -> None:
        self.flights = flights
        self.gate = gate
        self.ledger = ledger
        self.metrics = metrics

    def _running(self, pool: str | None, node: str | None) -> list[Running]:
        out = []
        for f in self.flights:
            if f.preempt is None or f.first_token_s is not None:
                continue
            if node is not None and f.node != node:
                continue
            r = self.gate.held.get(f.id)
            if r is not None and (pool is None or r.pool == pool):
                tokens = self.ledger.prefilling(f.id)
                out.append(Running(f.id, f.tenant.priority, r.kv_blocks, f.started, f.node, tokens))
        return out

    def running(self, pool: str) -> list[Running]:
        return self._running(pool, None)

    def on_node(self, node: str) -> list[Running]:
        return self._running(None, node)

    def preempt(self, request_id: str, rejection: Rejection) -> bool:
        f = self.flights.get(request_id)
        end = None if f is None or f.first_token_s is not None else f.preempt
        if f is None or end is None or not end(rejection):
            return False
        f.preempt = None
        self.metrics.preemptions.labels(f.tenant.priority).inc()
        return True
