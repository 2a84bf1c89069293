"""A weights canary: candidate weights (``kvgate tune``'s, say) decide a share of the requests
while the current weights decide the rest, so the two can be compared live before the candidate
is rolled out.

:class:`WeightsCanary` wraps the router's policy. Without a candidate it is the policy. With
one, a request whose session (or, without one, its request id) hashes below ``share`` is decided
by the candidate — a second instance of the same policy with the candidate weights — and its
decision records the candidate's ``weights_version``; the recorded decisions and outcomes then
split by version (the Grafana panel "TTFT and hit rate by weights version").

``kvgate weights --config candidate.yaml --version N --canary 0.1`` publishes it on
``kvgate.control`` (subject ``weights-canary/<policy>``; a share of 0 ends it); promoting the
candidate is an ordinary ``kvgate weights`` with a newer version, after which the canary ends.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from router.decision.policies import make_policy
from router.decision.types import NodeView, Policy, RouteDecision, RouteRequest
from router.decision.weights import CostWeights, SeedWeights
from router.settings import RouterSettings
from streams.schemas import ControlMessage

__all__ = ["WeightsCanary", "apply_weights_canary", "weights_canary_message"]

_WEIGHTS: dict[str, tuple[str, type[CostWeights] | type[SeedWeights]]] = {
    "kvgate": ("cost", CostWeights),
    "seed_score": ("weights", SeedWeights),
}


def weights_canary_message(
    policy: str, weights: dict[str, Any], share: float, now: float | None = None
) -> ControlMessage:
    return ControlMessage(
        subject=f"weights-canary/{policy}",
        kind="weights",
        ts=now or time.time(),
        payload={"policy": policy, "weights": weights, "canary_share": share},
    )


class WeightsCanary:
    """The router's policy, with an optional candidate for a share of the requests."""

    def __init__(self, base: Policy, settings: RouterSettings) -> None:
        self.base = base
        self.record_candidates = base.record_candidates
        self.settings = settings
        self.candidate: Policy | None = None
        self.share = 0.0
        self.decided = {"current": 0, "candidate": 0}

    def __getattr__(self, name: str) -> Any:  # everything else is the base policy's
        return getattr(self.base, name)

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def weights_version(self) -> int:
        return self.base.weights_version

    def set_candidate(self, weights: Mapping[str, Any], share: float) -> None:
        """Candidate weights for ``share`` of the requests (validated whole; share 0, or a
        version not newer than the current weights', ends the canary)."""
        field, model = _WEIGHTS[self.base.name]
        checked = model.model_validate(dict(weights))
        if share <= 0 or checked.version <= self.base.weights_version:
            self.candidate, self.share = None, 0.0
            return
        self.candidate = make_policy(self.settings.model_copy(update={field: checked}))
        self.share = share

    def promoted(self) -> None:
        """The current weights changed: a candidate they caught up with is over."""
        if self.candidate is not None and (
            self.candidate.weights_version <= self.base.weights_version
        ):
            self.candidate, self.share = None, 0.0

    def picks_candidate(self, request: RouteRequest) -> bool:
        if self.candidate is None:
            return False
        key = (request.session_id or request.request_id).encode()
        return zlib.crc32(key) / 0x1_0000_0000 < self.share

    def decide(
        self,
        request: RouteRequest,
        nodes: Sequence[NodeView],
        matches: Mapping[str, int],
        now: float,
    ) -> RouteDecision:
        if self.candidate is not None and self.picks_candidate(request):
            d = self.candidate.decide(request, nodes, matches, now)
            return replace(d, weights_version=self.candidate.weights_version)
        return self.base.decide(request, nodes, matches, now)

    def commit(
        self, request: RouteRequest, decision: RouteDecision, uncached_tokens: int, now: float
    ) -> None:
        """The policy that decided learns; with a canary running, each side's count of the
        requests it routed."""
        candidate = self.candidate
        if candidate is not None and decision.weights_version == candidate.weights_version:
            self.decided["candidate"] += 1
            candidate.commit(request, decision, uncached_tokens, now)
            return
        if candidate is not None:
            self.decided["current"] += 1
        self.base.commit(request, decision, uncached_tokens, now)

    def paused(self, session_id: str, node: str, now: float, until: float) -> None:
        """Both sides keep their sessions (either may have routed the turn)."""
        self.base.paused(session_id, node, now, until)
        if self.candidate is not None:
            self.candidate.paused(session_id, node, now, until)

    def resident_tokens(self, now: float) -> dict[str, int]:
        return self.base.resident_tokens(now)

    def state(self) -> dict[str, Any]:
        return {
            "share": self.share,
            "candidate_version": self.candidate.weights_version if self.candidate else None,
            "decided": dict(self.decided),
        }


def apply_weights_canary(policy: WeightsCanary, msg: ControlMessage) -> str:
    """Apply a ``weights-canary/<policy>`` message: ``applied``, ``ended``, ``other_policy``
    or ``invalid: ...``."""
    if msg.payload.get("policy") != policy.name:
        return "other_policy"
    if msg.subject != f"weights-canary/{policy.name}" or policy.name not in _WEIGHTS:
        return "invalid: a weights canary names its policy as weights-canary/<policy>"
    share, raw = msg.payload.get("canary_share"), msg.payload.get("weights")
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
        return "invalid: payload.canary_share must be a number in [0, 1]"
    if not isinstance(raw, dict):
        return "invalid: payload.weights must be an object"
    try:
        policy.set_candidate(raw, float(share))
    except (ValidationError, ValueError, TypeError) as exc:
        return f"invalid: {exc}".splitlines()[0]
    return "applied" if policy.candidate is not None else "ended"
