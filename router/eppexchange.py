"""One request's ext_proc exchange with the gateway (router/epp.py serves them): its headers
and body in, the picked endpoint (or the refusal) out, then its response watched until it ends.
Admission, routing and the records are the router's own (router/flow/external.py); nothing here
composes a decision."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from multidict import CIMultiDict

from admission.settings import Tenant
from router.decision.types import NodeView
from router.eppwire import (
    BUFFERED,
    DESTINATION,
    FULL_DUPLEX,
    LB_NAMESPACE,
    MAX_BODY_CHUNKS,
    SERVED,
    SUBSET,
    SUBSET_NAMESPACE,
    destination,
    error_json,
    header_map,
    host_port,
    immediate,
    refused,
    set_header,
)
from router.flow.entry import Entry
from router.flow.external import ExternalRequests
from router.flow.flight import EPP
from router.flow.headers import (
    API_KEY_HEADER,
    client_label,
    forwarded_peer,
    mint_id,
)
from router.flow.passadmit import PassthroughGate
from router.flow.refusals import Refusal
from router.flow.views import ClusterView
from router.http.passthrough import PASSTHROUGH, model_list, passthrough_node, request_model
from router.http.upstream import Upstream
from router.loops import Loops
from router.settings import RouterSettings
from router.sse import ResponseWatch
from streams.agentapis import agent_api

__all__ = ["DP_RANK_HEADER", "EppParts", "Exchange"]

log = logging.getLogger(__name__)

DP_RANK_HEADER = "x-data-parallel-rank"  # vLLM's: which rank of a data-parallel engine serves
# the answers that carry nothing but "go on" (never changed once made)
HEADERS_CONTINUE = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
RESPONSE_HEADERS_CONTINUE = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
BODY_CONTINUE = ep.ProcessingResponse(response_body=ep.BodyResponse())


@dataclass(frozen=True, slots=True)
class EppParts:
    """What the endpoint picker uses of its router."""

    settings: RouterSettings
    entry: Entry
    external: ExternalRequests
    upstream: Upstream
    loops: Loops
    views: ClusterView
    passing: PassthroughGate


@dataclass
class Exchange:
    """One HTTP request through the gateway."""

    parts: EppParts
    request_body_mode: int = BUFFERED
    response_body_mode: int = 0
    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)
    body: list[bytes] = field(default_factory=list)
    body_bytes: int = 0
    request_id: str | None = None
    started: float = field(default_factory=time.time)
    watch: ResponseWatch = field(default_factory=ResponseWatch)
    done: bool = False
    subset: set[str] | None = None  # ip:port the data plane allows (envoy.lb.subset_hint)
    passthrough: bool = False  # a non-generating endpoint's request (admitted, not routed)
    tenant: Tenant | None = None  # who the request's key names (read with its headers)
    passed: tuple[str, NodeView, bool, float] | None = None  # its id, node, reservation, start
    picked: list[NodeView] = field(default_factory=list)  # the pick, then its fallbacks

    async def on(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """The answers to one message of the stream."""
        out = self.at_once(req)
        return out if out is not None else await self.later(req)

    def at_once(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse] | None:
        """The answers to ``req`` where no waiting is needed; None where :meth:`later` gives
        them (the request routed, the response finished). Most messages of an exchange — the
        headers before a body, the response's headers and chunks — are answered here, on the
        transport's own turn."""
        hint = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        if hint is not None and SUBSET in hint.fields:  # the data plane narrows the choice
            values = hint.fields[SUBSET].list_value.values
            self.subset = {v.string_value for v in values if v.string_value}
        if req.HasField("protocol_config"):
            self.request_body_mode = req.protocol_config.request_body_mode or BUFFERED
            self.response_body_mode = req.protocol_config.response_body_mode
        kind = req.WhichOneof("request")
        if kind in ("request_headers", "request_body") and self.request_id is not None:
            # one request per stream: routing a second would hold a second reservation, and
            # the first would be held until its lease ran out
            return [immediate(400, error_json("this stream's request is routed already"), {})]
        if kind == "request_headers":
            self.headers = header_map(req.request_headers)
            try:  # the tenant's key, before a byte of its body is read
                self.tenant = self.parts.entry.reader.tenant(self.headers)
            except Refusal as exc:
                return [refused(exc)]
            path = self.headers.get(":path", "").split("?", 1)[0]
            if path == "/v1/models" and self.headers.get(":method", "GET").upper() == "GET":
                now = time.time()  # the whole fleet's, answered here (as the router's route)
                listed = model_list(self.parts.views.nodes(now), now)
                limit = self.parts.settings.client_id_max_len
                client_id = client_label(self.headers, "x-request-id", limit)
                rid = self.parts.passing.listed(self.tenant, client_id)
                return [immediate(200, orjson.dumps(listed), {"x-request-id": rid})]
            self.passthrough = path in PASSTHROUGH
            if req.request_headers.end_of_stream:  # no body to route by
                return None
            if self.request_body_mode == FULL_DUPLEX:
                return []  # the headers are answered once the body is in
            if self.request_body_mode != BUFFERED:
                return [
                    immediate(
                        500,
                        error_json(
                            "kvgate's EPP needs request_body_mode BUFFERED or FULL_DUPLEX_STREAMED"
                        ),
                        {},
                    )
                ]
            return [HEADERS_CONTINUE]
        if kind == "request_body":
            self.body.append(req.request_body.body)
            self.body_bytes += len(req.request_body.body)
            limit = self.parts.settings.max_body_bytes
            if self.body_bytes > limit:  # refused as it grows, not once it is all held
                return [immediate(413, error_json(f"the body is over {limit} bytes"), {})]
            if len(self.body) > MAX_BODY_CHUNKS:
                return [immediate(413, error_json("request body in too many pieces"), {})]
            return None if req.request_body.end_of_stream else []
        if kind == "request_trailers":
            return [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            self._served(req)
            h = header_map(req.response_headers)
            with contextlib.suppress(ValueError):
                self.watch.status = int(h.get(":status", "0"))
            return None if req.response_headers.end_of_stream else [RESPONSE_HEADERS_CONTINUE]
        if kind == "response_body":
            chunk = req.response_body
            first = self.watch.first_token_s is None
            self.watch.chunk(chunk.body, time.time())
            if first and self.watch.first_token_s is not None and self.request_id is not None:
                self.parts.external.first_token(self.request_id)  # its prefill is done
            return None if chunk.end_of_stream else [self._body_answer(chunk)]
        if kind == "response_trailers":
            return None
        return []

    async def later(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """The answers :meth:`at_once` left (it has seen ``req``): the request routed (or
        passed through) once all of it is in, the exchange finished with its response."""
        kind = req.WhichOneof("request")
        if kind in ("request_headers", "request_body"):
            return await self._pass() if self.passthrough else await self._route()
        await self._finish()
        if kind == "response_headers":
            return [RESPONSE_HEADERS_CONTINUE]
        if kind == "response_body":
            return [self._body_answer(req.response_body)]
        return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]

    def _body_answer(self, chunk: ep.HttpBody) -> ep.ProcessingResponse:
        if self.response_body_mode != FULL_DUPLEX:
            return BODY_CONTINUE
        streamed = ep.StreamedBodyResponse(body=chunk.body, end_of_stream=chunk.end_of_stream)
        return ep.ProcessingResponse(
            response_body=ep.BodyResponse(
                response=ep.CommonResponse(
                    body_mutation=ep.BodyMutation(streamed_response=streamed)
                )
            )
        )

    async def _route(self) -> list[ep.ProcessingResponse]:
        raw = b"".join(self.body)

        async def read() -> bytes:
            return raw

        try:
            # the agent APIs by their path (Envoy's ``:path``): the chat the engine makes of
            # them is what is routed; anything else is chat or completion by its body
            api = agent_api(self.headers.get(":path", ""))
            self.watch.api = api
            taken = await self.parts.entry.take(
                self.headers,
                read,
                True if api else None,
                forwarded_peer(self.headers),
                None,
                api,
                hold=False,
            )
            subset = self.subset
            allowed = None if subset is None else (lambda n: host_port(n.endpoint) in subset)
            routed = await self.parts.external.route(EPP, taken, allowed)
        except Refusal as exc:
            return [refused(exc)]
        self.request_id, _, decision, node, parsed = routed
        tenant = taken.gated.tenant.name
        p = self.parts.entry.for_node(parsed, tenant, node)
        log.debug("EPP %s -> %s (%s)", self.request_id, node.node_id, decision.reason)
        body = orjson.dumps(p.body)  # what the engine is asked (default max_tokens added)
        self.picked = [node]
        fallbacks = self.parts.settings.epp_fallbacks
        now = time.time()
        views = {n.node_id: n for n in self.parts.views.nodes(now)} if fallbacks else {}
        for c in (
            decision.candidates if fallbacks else ()
        ):  # the next best, where the same request can go as it is
            if len(self.picked) > fallbacks:
                break
            n = views.get(c.node_id)
            same = (
                n is not None
                and n.node_id != node.node_id
                and c.healthy
                and n.healthy
                and n.alive(now)
                and (self.subset is None or host_port(n.endpoint) in self.subset)
                and n.engine_headers == node.engine_headers
                and n.dp_rank is None
                and node.dp_rank is None
                and orjson.dumps(self.parts.entry.for_node(parsed, tenant, n).body) == body
            )
            if same and n is not None:
                self.picked.append(n)
        return self._send_to(node, body, raw)

    def _served(self, req: ep.ProcessingRequest) -> None:
        """Which of the endpoints named served the request, as the data plane reports it
        (``envoy.lb`` → ``x-gateway-destination-endpoint-served``): a fallback's, and the
        request is counted on that node from here on."""
        lb = req.metadata_context.filter_metadata.get(LB_NAMESPACE)
        served = lb.fields.get(SERVED) if lb is not None else None
        if served is None or self.request_id is None or len(self.picked) < 2:
            return
        endpoint = served.string_value
        node = next((n for n in self.picked[1:] if host_port(n.endpoint) == endpoint), None)
        if node is not None:
            self.parts.external.served_by(self.request_id, node)

    async def _pass(self) -> list[ep.ProcessingResponse]:
        """A request of a non-generating endpoint (router/http/passthrough.py): to the least
        loaded node serving its model, as the router's own route sends it — admitted at the KV
        of its input (released at the stream's end), recorded, its body as it came."""
        raw = b"".join(self.body)
        s = self.parts.settings
        try:
            model = request_model(raw)
            now = time.time()
            nodes = self.parts.views.nodes(now)
            if self.subset is not None:
                nodes = [n for n in nodes if host_port(n.endpoint) in self.subset]
            node = passthrough_node(nodes, model, now, s.max_queue)
            tenant = self.tenant or self.parts.entry.reader.tenant(self.headers)
            kind = PASSTHROUGH[self.headers.get(":path", "").split("?", 1)[0]]
            client_id = client_label(self.headers, "x-request-id", s.client_id_max_len)
            request_id = mint_id()
            held = await self.parts.passing.admit(
                request_id, kind, tenant, model, raw, node, client_id
            )
            self.passed = (request_id, node, held, now)
        except Refusal as exc:
            return [refused(exc)]
        return self._send_to(node, raw, raw)

    def _send_to(self, node: NodeView, body: bytes, raw: bytes) -> list[ep.ProcessingResponse]:
        """The pick, in the mode the request's body came in: ``node`` as the destination
        (header and ``envoy.lb`` metadata), ``body`` in place of ``raw`` where they differ."""
        # the pick first, then its fallbacks (the EPP protocol's ordered list)
        dest = ",".join(host_port(n.endpoint) for n in self.picked or [node])
        upstream = self.parts.upstream.auth
        mutation = ep.HeaderMutation(
            set_headers=[set_header(DESTINATION, dest), set_header("x-kvgate-node", node.node_id)]
            + [set_header(k.lower(), v) for k, v in node.engine_headers.items()]
            + [set_header(k.lower(), v) for k, v in upstream.items()],
            # the tenant's key is kvgate's business, never the engine's; so is the rank of a
            # data-parallel engine (a client's own would pick the rank routing did not)
            remove_headers=([] if upstream else ["authorization"])
            + [API_KEY_HEADER]
            + ([] if node.dp_rank is not None else [DP_RANK_HEADER]),
        )
        metadata = destination(dest)
        if self.request_body_mode == FULL_DUPLEX:
            return [
                ep.ProcessingResponse(
                    request_headers=ep.HeadersResponse(
                        response=ep.CommonResponse(header_mutation=mutation)
                    ),
                    dynamic_metadata=metadata,
                ),
                ep.ProcessingResponse(
                    request_body=ep.BodyResponse(
                        response=ep.CommonResponse(
                            body_mutation=ep.BodyMutation(
                                streamed_response=ep.StreamedBodyResponse(
                                    body=body, end_of_stream=True
                                )
                            )
                        )
                    )
                ),
            ]
        common = ep.CommonResponse(header_mutation=mutation)
        if body != raw:
            common.body_mutation.body = body
            common.header_mutation.remove_headers.append("content-length")
        if not self.body:  # answered on the headers (no body came)
            return [
                ep.ProcessingResponse(
                    request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
                )
            ]
        return [
            ep.ProcessingResponse(
                request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata
            )
        ]

    async def _finish(self, cancelled: bool = False) -> None:
        passed, self.passed = self.passed, None
        if passed is not None:  # a pass-through request's: the engine has answered (or gone)
            await self.parts.passing.finished(*passed, self.watch.status, None, cancelled)
        if self.done or self.request_id is None:
            return
        self.done = True
        w = self.watch
        status: Literal["ok", "error", "cancelled"] = (
            "cancelled" if cancelled else "ok" if 200 <= w.status < 300 else "error"
        )
        usage = w.usage or {}
        output = usage.get("completion_tokens", w.output_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        prompt = usage.get("prompt_tokens")
        await self.parts.external.finish(
            self.request_id,
            status,
            int(output) if isinstance(output, int) else w.output_tokens,
            None if w.first_token_s is None else w.first_token_s - self.started,
            cached if isinstance(cached, int) else None,
            prompt if isinstance(prompt, int) else None,
        )

    def holds(self) -> bool:
        """Whether anything is still held for the exchange (released by :meth:`close`)."""
        return self.passed is not None or (not self.done and self.request_id is not None)

    async def close(self) -> None:
        """The gRPC stream ended: whatever is still held is released (as cancelled)."""
        await self._finish(cancelled=True)
