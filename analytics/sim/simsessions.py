"""Agent sessions in the simulator as the live router keeps them (router/flow/sessions.py): the
inter-turn gaps learned with the router's core (router/decision/turngap.py), and the retention
hint each session's turn carries to its engine (``router.session_retention``)."""

from __future__ import annotations

from analytics.sim.simconfig import MODEL, SimConfig
from router.decision.turngap import TurnGaps

__all__ = ["SimSessions"]

KIND = ("", MODEL)  # the (tenant, model) whose gaps the simulated sessions teach


class SimSessions:
    def __init__(self, cfg: SimConfig) -> None:
        self.gaps = TurnGaps(default_s=cfg.session_hold_default_s, ceiling_s=cfg.session_hold_max_s)

    @classmethod
    def of(cls, cfg: SimConfig) -> SimSessions | None:
        return cls(cfg) if cfg.session_retention else None

    def began(self, session: str | None, now: float) -> None:
        """A turn arrives: the gap since its session's last turn is learned."""
        if session is not None:
            self.gaps.began(session, KIND, now)

    def hint_s(self, session: str | None, now: float) -> float:
        """The retention hint of a turn sent at ``now`` (0: none)."""
        return 0.0 if session is None else self.gaps.hold_s(KIND, now)

    def ended(self, session: str | None, now: float) -> float | None:
        """A turn ended at ``now``: until when its session's prefix is held (None: no session),
        as the live router's SessionKeeper.ended."""
        if session is None:
            return None
        self.gaps.ended(session, KIND, now)
        return now + self.gaps.hold_s(KIND, now)
