"""What serving a request produced (the proxy's relay, the endpoint picker's watch, a gateway's
release): the outcome's fields, transport-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.decision.outlier import Failure

__all__ = ["Served"]


@dataclass(slots=True)
class Served:
    """What happened on the way through."""

    status: str = "error"  # ok | error | cancelled | preempted
    http_status: int = 502
    ttft_s: float | None = None
    output_tokens: int = 0
    usage: dict[str, Any] | None = None
    error: str | None = None
    cut_off: bool = False  # the client stopped reading, or the request ran past its limit
    failure: Failure | None = None  # the engine failed it (outlier ejection counts these)
    broken: bool = False  # its stream broke after the client got bytes, and can be continued

    @property
    def cached_tokens(self) -> int | None:
        if self.usage is None:
            return None
        cached = (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return None if cached is None else int(cached)
