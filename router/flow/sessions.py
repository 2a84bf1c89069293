"""Agent sessions between turns, at the request path's edges (router/decision/turngap.py has the
pure cores).

A session's turn arriving (admission) learns the gap since its last turn and ends its hold; a
turn leaving its node (the proxy's, the gateway's or the endpoint picker's end of a request)
starts a hold for the learned bound: the session's prefix on that node, as many blocks as its
prompt and output took; the routing policy learns of it (a resident session counts on its node
while it pauses: router/decision/residency.py). A turn sent to an engine whose agent says it
takes retention hints carries one (``agent_hint``: the session and ``cache_control.ttl``, the
bound), so the engine keeps the prefix for the gap instead of evicting it first; a client's own
``agent_hint`` never reaches an engine (router/parse.py drops it).
"""

from __future__ import annotations

from dataclasses import replace

from router.decision.turngap import Hold, PausedSessions, TurnGaps
from router.decision.types import NodeView, Policy
from router.parse import ParsedRequest
from router.settings import RouterSettings

__all__ = ["SessionKeeper"]


class SessionKeeper:
    def __init__(self, settings: RouterSettings, policy: Policy | None = None) -> None:
        self.enabled = settings.session_retention
        self.policy = policy  # told of each pause: where its resident sessions live
        self.block_size = settings.block_size
        self.gaps = TurnGaps(
            default_s=settings.session_hold_default_s, ceiling_s=settings.session_hold_max_s
        )
        self.paused = PausedSessions()
        self.resumed_held = 0  # turns that came back while their hold was on
        self.expired = 0  # holds that ended with their bound

    def arrived(self, p: ParsedRequest, tenant: str, now: float) -> Hold | None:
        """A turn arrives: the gap since the session's last turn is learned, its hold ends (the
        hold, when it was still on: the session resumes with its KV kept)."""
        if not self.enabled or p.session_id is None:
            return None
        self.expire(now)
        self.gaps.began(p.session_id, (tenant, p.model), now)
        hold = self.paused.resume(p.session_id, now)
        if hold is not None:
            self.resumed_held += 1
        return hold

    def hinted(self, p: ParsedRequest, tenant: str, node: NodeView, now: float) -> ParsedRequest:
        """``p`` as sent to ``node`` at ``now``: with a retention hint where its engine takes
        one."""
        if not self.enabled or p.session_id is None or not node.retention_hints:
            return p
        ttl = round(self.gaps.hold_s((tenant, p.model), now), 1)
        hint = {"session_id": p.session_id, "cache_control": {"type": "ephemeral", "ttl": ttl}}
        return replace(p, body={**p.body, "agent_hint": hint})

    def ended(
        self, p: ParsedRequest, tenant: str, node: str, ok: bool, output_tokens: int, now: float
    ) -> Hold | None:
        """A turn left ``node`` (``ok``: answered): the session pauses, its prefix held there
        for the bound its kind's gaps give."""
        if not self.enabled or p.session_id is None or not ok or not node:
            return None
        kind = (tenant, p.model)
        self.gaps.ended(p.session_id, kind, now)
        blocks = (p.prompt_tokens_total + output_tokens) // self.block_size
        hold = Hold(p.session_id, node, blocks, now + self.gaps.hold_s(kind, now))
        self.paused.pause(hold)
        if self.policy is not None:
            self.policy.paused(p.session_id, node, now, hold.until)
        return hold

    def expire(self, now: float) -> None:
        self.expired += len(self.paused.expire(now))

    def report(self, now: float) -> dict[str, object]:
        """What ``/v1/kvgate/state`` shows of paused sessions."""
        self.expire(now)
        return {
            "enabled": self.enabled,
            "paused": len(self.paused),
            "held_blocks_by_node": self.paused.blocks_by_node(),
            "resumed_while_held": self.resumed_held,
            "expired": self.expired,
            "gaps": self.gaps.report(),
            # the long-context sessions the policy counts on each node (room and overflow)
            "resident_tokens_by_node": self.policy.resident_tokens(now) if self.policy else {},
        }
