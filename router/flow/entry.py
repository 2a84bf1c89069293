"""The way in, for every surface: read a request (router/flow/intake.py), then admit it
(:meth:`~router.flow.director.Director.admit`). A refusal on the way is recorded as a decision
too. The proxy, the gateway API and the endpoint picker all come in here."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace

from router.decision.types import NodeView
from router.flow.asks import Gated
from router.flow.director import Director
from router.flow.intake import Head, IntakeReader
from router.flow.recorder import Recorder
from router.flow.refusals import Refusal
from router.flow.sessions import SessionKeeper
from router.parse import ParsedRequest, as_token_ids
from streams.agentapis import Api

__all__ = ["Entry", "Taken"]


@dataclass(frozen=True, slots=True)
class Taken:
    """A request read and past admission (admitted, or refused by admission only: routing
    records that refusal)."""

    request_id: str  # minted by kvgate: nothing a client chose names state
    started: float  # wall clock at arrival
    parsed: ParsedRequest
    gated: Gated
    t0: float  # the decision clock's start (perf_counter)

    @property
    def admitted(self) -> bool:
        """It holds a reservation (admission on and it said yes)."""
        v = self.gated.verdict
        return v is not None and v.admitted


class Entry:
    def __init__(
        self,
        reader: IntakeReader,
        director: Director,
        recorder: Recorder,
        sessions: SessionKeeper | None = None,
    ) -> None:
        self.reader = reader
        self.director = director
        self.recorder = recorder
        self.sessions = sessions

    async def take(
        self,
        headers: Mapping[str, str],
        read: Callable[[], Awaitable[bytes]],
        chat: bool | None,
        peer: str | None = None,
        head: Head | None = None,
        api: Api | None = None,
        hold: bool = True,
    ) -> Taken:
        """Check the headers, authenticate, then read, parse (``chat`` None: chat when the
        body has ``messages``) and admit a request known by its headers and a reader of its
        body; ``peer``: the client's address, when known; ``head``: its headers checked
        already (:meth:`IntakeReader.head`, before the body arrived); ``api``: a Messages or
        Responses request; ``hold`` False: a gateway's, never held here (it waits for its
        answer itself)."""
        started = time.time() if head is None else head.started
        i = await self.reader.read(headers, read, chat, peer, started, head, api)
        if self.sessions is not None:  # a session's turn: its gap learned, its hold ended
            if self.sessions.arrived(i.parsed, i.tenant.name, started) is not None:
                i = replace(i, resuming=True)  # it queues ahead of new sessions (bounded)
        t0 = time.perf_counter()
        try:
            g = await self.director.admit(i, hold)
        except Refusal as exc:
            self.recorder.refusal(
                i.request_id, started, exc.reason, i.tenant.name, i.parsed, i.client_request_id
            )
            raise
        return Taken(i.request_id, started, i.parsed, g, t0)

    def for_node(self, p: ParsedRequest, tenant: str, node: NodeView) -> ParsedRequest:
        """``p`` as sent to ``node`` (by the proxy or the endpoint picker): with a retention
        hint where its engine takes one, and as token ids where the engine's tokenizer has
        agreed with the router's on the model (the engine need not tokenize it again)."""
        if self.sessions is not None:
            p = self.sessions.hinted(p, tenant, node, time.time())
        if self.reader.settings.forward_token_ids and self.reader.tokencheck.agrees(p.model):
            p = as_token_ids(p)
        return p
