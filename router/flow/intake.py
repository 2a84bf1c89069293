"""Intake: a request's headers and body → an :class:`Intake`, or a :class:`Refusal`.

Identical for every surface: the proxy reads a body from its HTTP request, the endpoint picker
hands the one Envoy streamed. In order, before anything is reserved: client labels
(``X-Request-Id``, ``Idempotency-Key``), the tenant's key (before a byte of the body is read),
the priority a request may lower itself to, placement labels, the SLO class; then the body is
read (bounded by its reader), parsed and tokenized. The request id is minted here: nothing a
client chose names state. A refusal is recorded as a decision (rate-limited) and counted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from hashlib import blake2b

import orjson
from pydantic import ValidationError

from admission.core import Rejection
from admission.gate import AdmissionGate
from admission.settings import Tenant
from admission.slo import Slo, slo_of
from router.decision.placement import Placement, placement_of
from router.flow.headers import (
    PARENT_SESSION_HEADERS,
    client_label,
    mint_id,
    requested_priority,
    session_label,
    tenant_key,
)
from router.flow.offload import OFFLOAD_BYTES, offloaded
from router.flow.recorder import Recorder
from router.flow.refusals import Refusal
from router.flow.salt import isolated
from router.flow.views import ClusterView
from router.metrics import RouterMetrics
from router.parse import ParsedRequest, parse_request
from router.settings import RouterSettings
from router.tokencheck import TokenCheck
from streams.agentapis import Api
from streams.tokenization import APPROXIMATE, Tokenization, load_tokenization

__all__ = ["Head", "Intake", "IntakeReader", "attempt_fingerprint", "client_identity"]


def attempt_fingerprint(client: str, p: ParsedRequest) -> str:
    """The same request from the same client: retries of one attempt share this."""
    h = blake2b(f"{client}|{p.model}|{p.max_tokens}|{p.cache_salt or ''}|".encode(), digest_size=12)
    h.update(p.tokens_digest)
    return h.hexdigest()


def client_identity(tenant: Tenant, anonymous: Tenant, peer: str | None) -> str:
    """Who the retry-storm guard holds to account: the tenant of an API key, or an anonymous
    client's network address (anonymous clients are not one identity)."""
    if tenant.name != anonymous.name or not peer:
        return tenant.name
    return f"{tenant.name}@{peer}"


@dataclass(frozen=True, slots=True)
class Intake:
    """A request past intake: authenticated, read, parsed; nothing reserved yet."""

    request_id: str  # minted here
    started: float
    tenant: Tenant  # at the priority the request runs at
    client: str  # who the retry guard holds to account
    idempotency_key: str | None
    client_request_id: str | None  # the client's X-Request-Id: a label, never a key
    placement: Placement
    slo: Slo | None
    parsed: ParsedRequest
    resuming: bool = False  # an agent session's next turn while its KV is held


@dataclass(frozen=True, slots=True)
class Head:
    """What a request's headers say, checked (before a byte of its body is read)."""

    request_id: str  # minted here
    started: float
    tenant: Tenant  # at the priority the request asks to run at
    client_request_id: str | None
    idempotency_key: str | None
    placement: Placement
    slo: Slo | None
    session_id: str | None = None  # the session an agent client names in a header
    parent_session_id: str | None = None  # a subagent's parent session, named in a header


@dataclass(slots=True)
class _Known:
    """What is known of a request so far (for the record of a refusal)."""

    tenant: str = "unauthenticated"
    client_request_id: str | None = None
    parsed: ParsedRequest | None = None


class IntakeReader:
    def __init__(
        self,
        settings: RouterSettings,
        gate: AdmissionGate,
        views: ClusterView,
        tokencheck: TokenCheck,
        metrics: RouterMetrics,
        recorder: Recorder,
    ) -> None:
        self.settings = settings
        self.gate = gate
        self.views = views
        self.tokencheck = tokencheck
        self.metrics = metrics
        self.recorder = recorder
        # loaded once: a bad tokenizer path fails at start, not on the first request
        self.tokenizations = {m: load_tokenization(t) for m, t in settings.tokenizers.items()}
        self._zone = (settings.zone_label, settings.zone) if settings.zone else None
        # tenants' caches kept apart (router.flow.salt) where there are tenants to keep apart
        self.isolating = settings.cache_isolation == "tenant" and bool(gate.settings.tenants)

    def tenant(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant a request's headers authenticate (a 401 refusal when none)."""
        tenant = self.gate.tenant(tenant_key(headers))
        if isinstance(tenant, Rejection):
            self.metrics.rejected(tenant.reason)
            raise Refusal(401, tenant.message, "unauthorized")
        return tenant

    def refuse(
        self, reason: str, status: int, message: str, type_: str = "invalid_request_error"
    ) -> Refusal:
        """A refusal before admission, counted (its decision record names ``reason``)."""
        self.metrics.rejected(reason)
        return Refusal(status, message, type_, reason=reason)

    def tokenization(self, model: str) -> Tokenization:
        """The model's tokenizer when configured (engine-exact hashes) and not found to differ
        from the engine's, else approximate."""
        if model not in self.tokenizations:  # an adapter: its base model's tokenizer
            model = self.views.adapter_base.get(model, model)
        if model in self.tokencheck.approximate:
            return APPROXIMATE
        return self.tokenizations.get(model, APPROXIMATE)

    def parse(self, raw: bytes, chat: bool, api: Api | None = None) -> ParsedRequest:
        """``raw`` as a completion (``chat`` False) or chat request (``api``: a Messages or
        Responses one); a 400 naming what is wrong."""
        try:
            return parse_request(
                raw, chat, self.settings.default_max_tokens, self.tokenization, api
            )
        except orjson.JSONDecodeError as exc:
            raise self.refuse("bad_json", 400, f"invalid JSON: {exc}") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "body"
            raise self.refuse("bad_request", 400, f"{where}: {first['msg']}") from None
        except ValueError as exc:
            raise self.refuse("bad_request", 400, str(exc)) from None

    def head(self, headers: Mapping[str, str], started: float) -> Head:
        """Check what ``headers`` say, before any body is read (a refusal is recorded)."""
        request_id = mint_id()
        known = _Known()
        try:
            return self._head(headers, started, request_id, known)
        except Refusal as exc:
            self.recorder.refusal(
                request_id, started, exc.reason, known.tenant, None, known.client_request_id
            )
            raise

    async def read(
        self,
        headers: Mapping[str, str],
        body: Callable[[], Awaitable[bytes]],
        chat: bool | None,
        peer: str | None,
        started: float,
        head: Head | None = None,
        api: Api | None = None,
    ) -> Intake:
        """The request of ``headers`` and ``body`` (``chat`` None: chat when the body has
        ``messages``; ``peer``: the client's address, when known; ``head``: what
        :meth:`head` found in the headers already; ``api``: Messages or Responses)."""
        if head is None:
            head = self.head(headers, started)
        known = _Known(head.tenant.name, head.client_request_id)
        try:
            return await self._read(body, chat, peer, head, known, api)
        except Refusal as exc:
            self.recorder.refusal(
                head.request_id,
                head.started,
                exc.reason,
                known.tenant,
                known.parsed,
                known.client_request_id,
            )
            raise

    def _objective(self, headers: Mapping[str, str]) -> str | None:
        """The SLO class of the InferenceObjective the request names, if the router maps it."""
        classes = self.settings.objective_slo_classes
        if not classes:
            return None
        return classes.get(headers.get("x-gateway-inference-objective", "").strip()[:253])

    def _head(
        self, headers: Mapping[str, str], started: float, request_id: str, known: _Known
    ) -> Head:
        n = self.settings.client_id_max_len
        client_id = client_label(headers, "X-Request-Id", n)
        known.client_request_id = client_id
        idempotency_key = client_label(headers, "Idempotency-Key", n)
        tenant = self.tenant(headers)
        known.tenant = tenant.name
        priority = requested_priority(headers, self.settings.objective_priorities, tenant.priority)
        if priority != tenant.priority:  # the request asked to be treated as less important
            tenant = tenant.model_copy(update={"priority": priority})
        s = self.settings
        try:
            placement = placement_of(
                headers,
                tenant.require_labels,
                tenant.prefer_labels,
                self._zone,
                s.prefer_spill_kv_ratio,
                s.prefer_spill_queue,
            )
        except ValueError as exc:
            raise self.refuse("bad_labels", 400, f"labels: {exc}") from None
        try:
            slo, tenant = slo_of(headers, tenant, self.gate.settings, self._objective(headers))
        except ValueError as exc:
            raise self.refuse("bad_slo_class", 400, str(exc)) from None
        session = session_label(headers, s.session_headers)
        parent = session_label(headers, PARENT_SESSION_HEADERS)
        return Head(
            request_id,
            started,
            tenant,
            client_id,
            idempotency_key,
            placement,
            slo,
            session,
            parent,
        )

    async def _read(
        self,
        body: Callable[[], Awaitable[bytes]],
        chat: bool | None,
        peer: str | None,
        head: Head,
        known: _Known,
        api: Api | None,
    ) -> Intake:
        tenant = head.tenant
        raw = await body()
        if chat is None:
            try:
                chat = b'"messages"' in raw and "messages" in orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise self.refuse("bad_json", 400, f"invalid JSON: {exc}") from None
            except TypeError:  # a JSON value without keys
                chat = False
        p = (
            await offloaded(self.parse, raw, chat, api)
            if len(raw) > OFFLOAD_BYTES
            else self.parse(raw, chat, api)
        )
        if "priority" in p.body and not tenant.engine_priority:
            # the engine's own priority scheduling: a tenant jumping every queue on its engine
            p = replace(p, body={k: v for k, v in p.body.items() if k != "priority"})
        if head.session_id is not None:  # the client's session header wins over the body's
            p = replace(p, session_id=head.session_id)
        if head.parent_session_id is not None:
            p = replace(p, parent_session_id=head.parent_session_id)
        if self.isolating:
            if p.kind == "messages":
                known.parsed = p
                # the engines' Messages API takes no cache_salt: its prefixes are shared by
                # every tenant, which isolation exists to prevent
                raise self.refuse(
                    "isolation_unsupported",
                    400,
                    "/v1/messages cannot keep tenants' cached prefixes apart (the engine's "
                    "Messages API takes no cache_salt): use /v1/chat/completions or "
                    "/v1/responses, or run the router with router.cache_isolation=off",
                )
            p = isolated(p, tenant)
        known.parsed = p
        client = client_identity(tenant, self.gate.settings.anonymous, peer)
        h = head
        return Intake(
            h.request_id,
            h.started,
            tenant,
            client,
            h.idempotency_key,
            h.client_request_id,
            h.placement,
            h.slo,
            p,
        )
