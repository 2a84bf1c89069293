"""What routing is handed of a request: :class:`Gated` (past admission) and its
:class:`~router.decision.types.RouteRequest`."""

from __future__ import annotations

from dataclasses import dataclass

from admission.core import Verdict
from admission.settings import Tenant
from admission.slo import Slo
from router.decision.types import NodeView, RouteRequest
from router.parse import ParsedRequest

__all__ = ["Gated", "queue_weight", "route_request"]


def queue_weight(slo: Slo | None) -> float:
    """How heavily routing weighs queueing for a request of ``slo``'s class."""
    return slo[1].queue_weight if slo is not None else 1.0


def route_request(
    request_id: str, p: ParsedRequest, hashes: list[int], weight: float = 1.0
) -> RouteRequest:
    """What routing knows of ``p``: its prompt's chained block ``hashes``, sizes, session."""
    return RouteRequest(
        request_id,
        p.model,
        hashes,
        p.prompt_tokens_total,
        p.max_tokens,
        p.session_id,
        weight,
        parent_session_id=p.parent_session_id,
    )


@dataclass(frozen=True, slots=True)
class Gated:
    """A request past tenant, model, node-health and admission checks: what routing needs."""

    tenant: Tenant
    nodes: list[NodeView]
    block_size: int
    verdict: Verdict | None  # None: admission is off
    now: float
    client_request_id: str | None = None  # the client's X-Request-Id: a label, never a key
    slo: Slo | None = None  # its SLO class (admission/slo.py)
    budget: tuple[str, list[int]] = ("", [])  # its admission budget: name, nodes' KV blocks
