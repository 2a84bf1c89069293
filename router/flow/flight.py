"""Routed requests in flight, each with an explicit owner (NVIDIA Dynamo's request guard).

A request this router routed holds a reservation and an entry in the in-flight ledger until it
finishes. Who answers for it is explicit, never inferred from what happens to be held:

* ``ROUTER``: a request this router proxies. It renews the reservation while the request runs
  and finishes it when the answer ends.
* ``EPP``: a request routed by this router's endpoint picker. The gateway forwards it and the
  picker watches the answer (first token, end of stream); this router renews its reservation
  while the stream is open, at most ``max_s`` (then it is finished as cancelled).
* a gateway's name: a request routed for a gateway through the gateway API. Only that gateway
  may renew or release it; when its lease runs out without a release, the router finishes it
  (released, recorded as cancelled) — it is never renewed on the gateway's behalf.

A reservation held by this router that no flight owns (a prefill leg's second reservation
excepted: it belongs to its request's flight) is renewed by no one and expires with its lease.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from admission.core import Rejection
from admission.settings import Tenant
from admission.slo import Slo
from router.parse import ParsedRequest

__all__ = ["EPP", "ROUTER", "Flight", "Flights"]

ROUTER = "router"
EPP = "epp"


@dataclass(slots=True)
class Flight:
    id: str
    node: str
    owner: str  # ROUTER, EPP, or the gateway that routed it
    parsed: ParsedRequest
    hashes: Sequence[int]
    tenant: Tenant
    started: float
    slo: Slo | None
    until: float  # a gateway's: its lease; the router's and the EPP's: their longest life
    admitted: bool = True  # holds a reservation
    first_token_s: float | None = None
    # a proxied stream that can go on from another node: ends its engine's answer so that it
    # does (its node drained past router.drain_grace_s); None otherwise
    cut: Callable[[str], None] | None = None
    # a sheddable stream its engine has not answered yet: ends it with a 503 preempted
    # (router/flow/preemption.py); False when too late (bytes reached the client)
    preempt: Callable[[Rejection], bool] | None = None

    @property
    def renewed_here(self) -> bool:
        """This router renews its reservation (its own requests and its EPP's)."""
        return self.owner in (ROUTER, EPP)


class Flights:
    """The registry of this router's flights, by request id."""

    def __init__(self) -> None:
        self._by_id: dict[str, Flight] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Flight]:
        return iter(list(self._by_id.values()))

    def add(self, f: Flight) -> None:
        self._by_id[f.id] = f

    def get(self, rid: str) -> Flight | None:
        return self._by_id.get(rid)

    def pop(self, rid: str) -> Flight | None:
        return self._by_id.pop(rid, None)

    def owned(self, owner: str, rid: str) -> Flight | None:
        """``rid`` if ``owner`` owns it (else None: another's is not even visible)."""
        f = self._by_id.get(rid)
        return f if f is not None and f.owner == owner else None

    def renews(self, reservation_id: str) -> bool:
        """Whether this router renews ``reservation_id``: one of its own or its EPP's flights,
        or a second reservation of such a flight (``<id>/prefill``)."""
        f = self._by_id.get(reservation_id.partition("/")[0])
        return f is not None and f.renewed_here

    def expired(self, now: float) -> list[Flight]:
        """Flights past their ``until`` that the router must end itself: a gateway's whose
        lease ran out, the EPP's past their longest life (the router's own proxied requests
        end with their proxy, which bounds them itself)."""
        return [f for f in self._by_id.values() if f.owner != ROUTER and f.until <= now]

    def by_priority(self) -> Counter[str]:
        return Counter(f.tenant.priority for f in self._by_id.values())
