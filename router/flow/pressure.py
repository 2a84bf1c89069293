"""Whether a pool's KV is contended now: the signal that lets the router cut a stalled stream
within seconds instead of its write timeout.

A streaming client that stops reading keeps its request's KV on the engine (the engine goes on
generating into buffers) and its reservation in the budget. Alone, that costs nobody; while
other requests are refused or queued for KV, it is capacity a reading client could use. A pool is
*contended* for :attr:`Pressure.window_s` after admission refused or queued a request for
capacity (a watermark, a full queue, no room): someone is waiting for KV. A pool merely past
its yellow watermark, with nobody refused, is not.
"""

from __future__ import annotations

from admission.core import RejectReason, Verdict

__all__ = ["Pressure"]

# refusals that say the pool's KV or slots are short (not the tenant's quota, a retry, a store)
_CAPACITY = frozenset(
    {
        RejectReason.YELLOW_LOW_PRIORITY,
        RejectReason.RED_WATERMARK,
        RejectReason.QUEUE_FULL,
        RejectReason.QUEUE_TIMEOUT,
        RejectReason.DEADLINE,
        RejectReason.NO_FIT_NOW,
    }
)


class Pressure:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: dict[str, float] = {}  # pool -> when it was last contended

    def note(self, pool: str, verdict: Verdict, now: float) -> None:
        """Admission's ``verdict`` on a request of ``pool``."""
        rejection = verdict.rejection
        if (rejection is not None and rejection.reason in _CAPACITY) or verdict.queue_wait_s:
            self._last[pool] = now

    def contended(self, pool: str, now: float) -> bool:
        last = self._last.get(pool)
        return last is not None and now - last <= self.window_s
