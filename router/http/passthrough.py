"""The engines' non-generating OpenAI API (``/v1/embeddings``, ``/v1/score``, ``/v1/rerank``,
``/v1/classify``), passed through to a node that serves the request's model.

These requests hold no long generation and no reusable prefix: they are not admitted against
the KV budget and not routed by cache, only sent to the least loaded node serving their model.
The tenant's key is checked first, the body is bounded, the engine's answer is streamed back as
it comes, and the client sees which node answered (``X-Kvgate-Node``).

Only the paths of :data:`PASSTHROUGH_PATHS` pass, and each is sent upstream as the constant
path kvgate knows, never as the client spelled it: a client's path cannot name another engine
endpoint (``/v1/../reset_prefix_cache``), and engine admin endpoints under ``/v1``
(``/v1/load_lora_adapter``…) are not reachable by tenants. Generating endpoints are never
passed through: they are admitted and routed (router/http/openai.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from router.decision.types import NodeView, eligible
from router.flow.refusals import Refusal
from router.wire.server import Reply, Request
from streams.schemas import PassthroughKind

__all__ = [
    "PASSTHROUGH",
    "PASSTHROUGH_PATHS",
    "model_list",
    "passthrough_node",
    "pick_node",
    "relay",
    "request_model",
]

# the non-generating OpenAI-style endpoints vLLM and SGLang serve under /v1 (JSON bodies with
# a ``model``): they pass through; nothing else under /v1 does
PASSTHROUGH: dict[str, PassthroughKind] = {
    "/v1/embeddings": "embeddings",
    "/v1/score": "score",
    "/v1/rerank": "rerank",
    "/v1/classify": "classify",
}
PASSTHROUGH_PATHS = tuple(PASSTHROUGH)


def request_model(raw: bytes) -> str:
    """The ``model`` a pass-through request names (a 400 when the body has none)."""
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Refusal(400, f"the body is not JSON: {exc}") from None
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model or len(model) > 256:
        raise Refusal(400, "model: a model name is required to route this request")
    return model


def pick_node(nodes: Sequence[NodeView]) -> NodeView:
    """The least loaded of ``nodes`` (queue, then KV use; ties by id for stability)."""
    return min(nodes, key=lambda n: (n.queue_len, n.kv_used_ratio, n.node_id))


def passthrough_node(
    all_nodes: Sequence[NodeView], model: str, now: float, max_queue: int
) -> NodeView:
    """The node a pass-through request for ``model`` goes to: the least loaded of the eligible
    ones within the queue cap (404: no node serves the model; 503: none can take it now)."""
    if not any(n.serves(model) for n in all_nodes):
        raise Refusal(404, f"The model `{model[:200]}` does not exist.", "NotFoundError")
    nodes = [n for n in eligible(all_nodes, model, now) if n.waiting <= max_queue]
    if not nodes:
        raise Refusal(503, f"no healthy node serves `{model[:200]}` now", "service_unavailable")
    return pick_node(nodes)


def model_list(all_nodes: Sequence[NodeView], now: float) -> dict[str, Any]:
    """``GET /v1/models`` of the whole fleet: the base models and adapters of the live nodes."""
    live = [n for n in all_nodes if n.alive(now)]
    bases = {n.model for n in live}
    adapters = {a: n.model for n in live for a in n.adapters if a not in bases}
    entry = {"object": "model", "owned_by": "kvgate"}
    return {
        "object": "list",
        "data": [{**entry, "id": m, "root": m, "parent": None} for m in sorted(bases)]
        + [{**entry, "id": a, "root": a, "parent": adapters[a]} for a in sorted(adapters)],
    }


async def relay(
    http: aiohttp.ClientSession,
    request: Request,
    reply: Reply,
    node: NodeView,
    raw: bytes,
    headers: Mapping[str, str],
) -> tuple[int, str | None]:
    """POST ``raw`` to ``node`` at the request's route (one of :data:`PASSTHROUGH_PATHS`,
    the constant kvgate knows, not the client's spelling of it) and stream its answer back;
    the engine's status and, when its answer was cut, why (a :class:`Refusal` when nothing
    reached the client)."""
    path = next((p for p in PASSTHROUGH_PATHS if p == request.path), None)
    if path is None:  # routed only for those; a guard, not a filter
        raise Refusal(404, f"no such endpoint: {request.path[:200]}", "NotFoundError")
    query = f"?{request.query}" if request.query else ""
    url = node.endpoint.rstrip("/") + path + query
    try:
        async with http.post(
            url, data=raw, headers={"Content-Type": "application/json", **headers}
        ) as up:
            if up.status in (401, 403):  # the engine refused the router, not the client
                msg = f"node {node.node_id} refused the router's credentials"
                raise Refusal(502, msg, "upstream_auth")
            reply.start(
                up.status,
                up.headers.get("Content-Type", "application/json"),
                (("X-Kvgate-Node", node.node_id),),
            )
            status = up.status
            async for chunk in up.content.iter_chunked(64 << 10):
                await reply.write(chunk)
            reply.end()
            return status, None
    except (aiohttp.ClientError, TimeoutError) as exc:
        if reply.started:
            reply.abort()  # the answer is cut: the client must not take it for whole
            return reply.status, f"cut: {type(exc).__name__}"
        raise Refusal(502, f"node {node.node_id} did not answer: {type(exc).__name__}") from None
