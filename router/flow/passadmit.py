"""Admission of the requests that pass through to an engine without generating (embeddings,
score, rerank, classify; router/http/passthrough.py): they use an engine, so they hold their
share of the model's KV budget while they run — the KV of their input, no output — like every
other request, and are refused (429/503 with ``Retry-After``) when the budget has no room at
their priority. The router's HTTP route and the endpoint picker both admit them here."""

from __future__ import annotations

import time
from typing import Literal

from admission.gate import AdmissionGate
from admission.plan import AdmissionAsk
from admission.settings import Tenant
from router.decision.candidates import budget
from router.decision.types import NodeView, eligible
from router.flow.headers import mint_id
from router.flow.recorder import Recorder
from router.flow.refusals import Refusal
from router.flow.views import ClusterView
from router.metrics import RouterMetrics
from streams.schemas import PassthroughKind

__all__ = ["BYTES_PER_TOKEN", "PassthroughGate", "input_tokens"]

BYTES_PER_TOKEN = 4  # the input's tokens, told from its body (no tokenizer on this path)


def input_tokens(raw: bytes) -> int:
    """About how many tokens a pass-through body's input takes (its bytes / 4, at least 1)."""
    return max(1, len(raw) // BYTES_PER_TOKEN)


class PassthroughGate:
    """Admission and the decision record of pass-through requests, for one router."""

    def __init__(
        self,
        gate: AdmissionGate,
        views: ClusterView,
        metrics: RouterMetrics,
        recorder: Recorder,
        block_size: int,
    ) -> None:
        self.gate, self.views, self.metrics = gate, views, metrics
        self.recorder, self.block_size = recorder, block_size

    async def admit(
        self,
        request_id: str,
        kind: PassthroughKind,
        tenant: Tenant,
        model: str,
        raw: bytes,
        node: NodeView,
        client_id: str | None,
    ) -> bool:
        """Admit the request sent to ``node`` and record the decision; True when it holds a
        reservation (the caller then calls :meth:`release` once the engine has answered), False
        when admission is off; a :class:`Refusal` (recorded as rejected) when it is refused."""
        now = time.time()
        verdict = None
        if self.gate.settings.enabled:
            all_nodes = self.views.nodes(now)
            nodes = eligible(all_nodes, model, now)
            pool, node_blocks = budget(all_nodes, nodes, model, now, self.views.adapter_base)
            ask = AdmissionAsk(
                request_id,
                tenant,
                input_tokens(raw),
                0,
                nodes[0].block_size if nodes else self.block_size,
                pool,
                node_blocks,
                model,
                attempt=f"{tenant.name}|{request_id}",
                client=tenant.name,
            )
            verdict = await self.gate.screen_and_admit(ask, now)
        self.recorder.passthrough(request_id, kind, model, tenant, node, now, client_id, verdict)
        if verdict is not None and not verdict.admitted and verdict.rejection is not None:
            self.metrics.rejected(verdict.rejection.reason)
            raise Refusal.of(verdict.rejection)
        return verdict is not None

    def listed(self, tenant: Tenant, client_id: str | None) -> str:
        """Record a ``GET /v1/models`` the router answers itself; its minted request id."""
        request_id = mint_id()
        self.recorder.listing(request_id, tenant, self.block_size, client_id)
        return request_id

    async def finished(
        self,
        request_id: str,
        node: NodeView,
        held: bool,
        started: float,
        http_status: int,
        error: str | None = None,
        cancelled: bool = False,
    ) -> None:
        """The engine answered (or not, or the client left): the reservation goes back, the
        outcome is recorded."""
        if held:
            await self.gate.release(request_id, time.time())
        ok = 200 <= http_status < 300 and error is None
        status: Literal["ok", "error", "cancelled"] = (
            "cancelled" if cancelled else "ok" if ok else "error"
        )
        self.recorder.passthrough_outcome(request_id, node, status, http_status, started, error)
