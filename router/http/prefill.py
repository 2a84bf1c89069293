"""The first leg of a request whose KV crosses between engines, through their KV connector:

* disaggregated prefill (router/decision/disagg.py): the prefill node computes the prompt
  (vLLM's flow: one token, not streamed, KV kept for a remote decode) while a second
  reservation holds that KV; the decode node then gets the request with the prefill node's
  transfer params;
* a pull (router/decision/pull.py): the node holding the prompt's prefix gets the prefix's
  token ids the same way (it computes one token: the rest is cached there) and the chosen node
  gets the request with the holder's params — it loads the prefix and computes the rest.

A leg that fails leaves the request unchanged: the chosen node computes the prompt itself."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from admission.gate import AdmissionGate
from router.decision.disagg import decode_body, prefill_body, valid_transfer_params
from router.decision.inflight import InflightLedger
from router.decision.outlier import Failure
from router.decision.pull import pull_body
from router.decision.types import RouteRequest
from router.flow.asks import Gated
from router.flow.director import Director
from router.flow.views import ClusterView
from router.http.upstream import Upstream
from router.metrics import RouterMetrics
from router.parse import ParsedRequest
from router.settings import RouterSettings

__all__ = ["PrefillLeg"]

log = logging.getLogger(__name__)

_ANSWER_BYTES = 1 << 20  # a prefill engine's one-token answer, with its transfer params


async def _read_bounded(up: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """An answer's body, or None when it is larger than ``limit``."""
    data = bytearray()
    async for chunk in up.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)


class PrefillLeg:
    def __init__(
        self,
        settings: RouterSettings,
        upstream: Upstream,
        gate: AdmissionGate,
        views: ClusterView,
        ledger: InflightLedger,
        director: Director,
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.gate = gate
        self.views = views
        self.ledger = ledger
        self.director = director
        self.metrics = metrics

    async def run(
        self, request_id: str, p: ParsedRequest, g: Gated, prefill: str, rreq: RouteRequest
    ) -> ParsedRequest:
        """Run the leg on node ``prefill``; the request for the decode node."""
        pnode = next((n for n in g.nodes if n.node_id == prefill), None)
        if pnode is None:
            return p
        key = f"{request_id}/prefill"
        now = time.time()
        extra = (
            g.verdict is not None
            and g.verdict.admitted
            and await self.gate.hold_extra(
                key,
                g.tenant,
                g.budget[0],
                math.ceil(p.prompt_tokens_total / g.block_size),
                g.budget[1],
                now,
            )
        )
        hit = self.views.matches(rreq.block_hashes, now, p.exact_tokens).get(prefill, 0)
        self.ledger.dispatch(key, prefill, now, max(0, rreq.prompt_tokens - hit * g.block_size))
        try:
            params, failure = await self._post(
                request_id,
                pnode.endpoint,
                pnode.engine_headers,
                p.path,
                prefill_body(p.body),
                self.settings.prefill_timeout_s,
            )
        finally:
            self.ledger.finish(key)
            if extra:
                await self.gate.release(key, time.time())
        self.director.observe(prefill, failure)
        if params is None:
            log.warning(
                "%s: prefill on %s gave no KV to transfer; decoding node computes it",
                request_id,
                prefill,
            )
            self.metrics.disaggregated.labels("fallback").inc()
            return p
        self.metrics.disaggregated.labels("ok").inc()
        return replace(p, body=decode_body(p.body, params))

    async def pull(
        self, request_id: str, p: ParsedRequest, g: Gated, holder: str, blocks: int
    ) -> ParsedRequest:
        """The first leg of a pull (router/decision/pull.py): ``holder`` is asked for the KV of
        the prompt's first ``blocks`` blocks (their token ids, one token, kept for a remote
        engine); the request for the chosen node, with the holder's transfer params — or as it
        is when the leg failed (the node computes the prompt: the same answer, later)."""
        hnode = next((n for n in g.nodes if n.node_id == holder), None)
        prefix = p.tokens[: blocks * g.block_size]
        if hnode is None or not p.exact_tokens or not prefix:  # its blocks are not the engine's
            self.metrics.kv_pulls.labels("fallback").inc()
            return p
        key = f"{request_id}/pull"
        self.ledger.dispatch(key, holder, time.time(), 0)
        try:
            params, failure = await self._post(
                request_id,
                hnode.endpoint,
                hnode.engine_headers,
                "/v1/completions",
                pull_body(p.body, p.model, prefix, self.settings.pull_priority),
                self.settings.pull_timeout_s,
            )
        finally:
            self.ledger.finish(key)
        self.director.observe(holder, failure)
        if params is None:
            log.warning("%s: %s gave no KV to pull; the prompt is computed", request_id, holder)
            self.metrics.kv_pulls.labels("fallback").inc()
            return p
        self.metrics.kv_pulls.labels("ok").inc()
        return replace(p, body=decode_body(p.body, params))

    async def _post(
        self,
        request_id: str,
        endpoint: str,
        engine_headers: dict[str, str],
        path: str,
        body: dict[str, Any],
        timeout_s: float,
    ) -> tuple[dict[str, Any] | None, Failure | None]:
        """A first leg's request: the engine's transfer params (None: none usable) and how the
        node failed, if it did."""
        try:
            async with (
                asyncio.timeout(timeout_s),
                self.upstream.session.post(
                    endpoint.rstrip("/") + path,
                    data=orjson.dumps(body),
                    headers={
                        "Content-Type": "application/json",
                        "X-Request-Id": request_id,
                        **engine_headers,
                        **self.upstream.auth,
                    },
                ) as up,
            ):
                data = await _read_bounded(up, _ANSWER_BYTES)
                if up.status >= 500:
                    return None, "5xx"
                if up.status == 200 and data is not None:
                    return valid_transfer_params(orjson.loads(data)), None
                return None, None
        except TimeoutError:
            return None, "timeout"
        except aiohttp.ClientError:
            return None, "connect"
        except ValueError:  # not JSON, or too large: the engine is no KV producer
            return None, None
