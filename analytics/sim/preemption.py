"""Preemption in the simulator (admission/preempt.py, the rule the live gate applies): the
requests the simulated engines have not given a first token yet, and ending one — its engine
frees its KV (:meth:`~analytics.sim.simcore.SimCore.abort`), admission gets its reservation
back, and its client hears the typed refusal (and retries as the retry model says), as a live
client of the router does. Every request is taken for a stream (its first token is known)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from admission.core import Rejection
from admission.preempt import Running
from analytics.sim.admission import Refused
from analytics.sim.arrivals import retry
from analytics.sim.simcore import DONE, SimSeq

if TYPE_CHECKING:
    from analytics.sim.cluster import SimCluster

__all__ = ["SimPreemption"]


class SimPreemption:
    """:class:`admission.preempt.Preemptible` over a simulated cluster's engines."""

    def __init__(self, sim: SimCluster) -> None:
        self.sim = sim
        self.sheddable = frozenset(
            sim.cfg.admission.preempt_priorities if sim.cfg.admission else ()
        )
        self.seqs: dict[str, tuple[SimSeq, str, float]] = {}  # sheddable: (seq, node, sent at)
        self.now = 0.0  # the event being handled (the cluster sets it)

    def sent(self, idx: int, seq: SimSeq, node: str, now: float) -> None:
        if self.sim.requests[idx].priority in self.sheddable:
            self.seqs[seq.request_id] = (seq, node, now)

    def ended(self, rid: str) -> None:
        self.seqs.pop(rid, None)

    def _running(self, node: str | None) -> list[Running]:
        adm = self.sim.adm
        assert adm is not None
        out = []
        for rid, (seq, on, at) in self.seqs.items():
            r = adm.store.get(rid)
            out_by = seq.first_token_s
            if node is not None and on != node:
                continue
            if (out_by is None or out_by > self.now) and seq.state != DONE and r is not None:
                p = self.sim.requests[int(rid[1:])].priority
                tokens = self.sim.ledger.prefilling(rid)  # (what a live router knows of it)
                out.append(Running(rid, p, r.kv_blocks, at, on, tokens))
        return out

    def running(self, pool: str) -> list[Running]:
        return self._running(None)

    def on_node(self, node: str) -> list[Running]:
        return self._running(node)

    def preempt(self, request_id: str, rejection: Rejection) -> bool:
        sim, now = self.sim, self.now
        got = self.seqs.get(request_id)
        if got is None or not sim.by_id[got[1]].core.abort(got[0], now):
            return False
        del self.seqs[request_id]
        sim.meta.pop(request_id, None)
        sim.waited.pop(request_id, None)
        sim.ledger.finish(request_id)
        assert sim.adm is not None
        sim.adm.release(request_id, now)
        idx = int(request_id[1:])
        r = sim.requests[idx]
        refused = Refused(idx, r.priority, rejection.reason, rejection.retry_after_s, now)
        retry(sim, r, idx, sim.attempts.get(idx, 1), refused, now)
        return True
