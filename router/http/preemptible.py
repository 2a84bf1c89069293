"""A sheddable stream's forward that preemption may end before its first byte
(router/flow/preemption.py; admission/preempt.py decides whom): the proxy races the engine's
answer against the preemption, so the client hears either the answer or one clean 503
``preempted`` — never half a stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from admission.core import Rejection
from router.decision.types import NodeView
from router.flow.flight import Flight
from router.flow.refusals import Refusal
from router.flow.served import Served
from router.http.proxy import Whole
from router.wire.server import Reply

__all__ = ["preemptible"]

log = logging.getLogger(__name__)


async def preemptible(
    f: Flight,
    reply: Reply,
    sending: Coroutine[Any, Any, tuple[Served, Whole | None]],
    request_id: str,
    node: NodeView,
) -> tuple[Served, Whole | None]:
    """``sending`` (the forward of a sheddable stream), ended when the flight is preempted
    before any byte reached the client: the engine's connection closes (it aborts the request
    and frees its KV) and the client gets the typed 503 ``preempted``, with Retry-After."""
    stop: asyncio.Future[Rejection] = asyncio.get_running_loop().create_future()

    def preempt(rej: Rejection) -> bool:
        if reply.started or stop.done():
            return False
        stop.set_result(rej)
        return True

    task = asyncio.ensure_future(sending)
    f.preempt = preempt
    try:
        await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client went away
        task.cancel()
        raise
    finally:
        f.preempt = None
    if task.done() or reply.started:  # (it answered in the instant it was preempted)
        return await task
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    rej = stop.result()
    log.info("%s: preempted on %s: %s", request_id, node.node_id, rej.message)
    refusal = Refusal.of(rej)
    headers = (
        ("X-Kvgate-Node", node.node_id),
        ("X-Request-Id", request_id),
        *refusal.headers.items(),
    )
    served = Served(status="preempted", http_status=refusal.status, error=rej.message)
    return served, Whole(refusal.status, refusal.body(), headers=headers)
