"""SLO classes: which service level a request is held to, and the refusal of one that cannot
meet its TTFT (pure; shared by the live router and the simulator).

A request's class comes from its credential (the tenant's ``slo_class``) or from the
``X-Kvgate-Slo-Class`` header, when the tenant may use that class: one listed in its
``slo_classes``, or, without a list, any class whose priority is not above the tenant's. A class
never raises a request above its tenant's priority. With a class:

* admission queues it at most until its TTFT target (never past its priority's queue limit);
* routing weighs the node's queue by the class's ``queue_weight`` (tight classes avoid queues);
* a request whose best node's expected queue + prefill already exceeds its TTFT target is
  refused at once (429 ``deadline`` with Retry-After), rather than served late.
"""

from __future__ import annotations

from collections.abc import Mapping

from admission.core import Rejection, RejectReason, retry_after
from admission.queue import ORDER
from admission.settings import AdmissionSettings, Priority, SloClass, Tenant

__all__ = [
    "SLO_HEADER",
    "Slo",
    "deadline_refusal",
    "expected_ttft_s",
    "held",
    "late_refusal",
    "slo_of",
]

SLO_HEADER = "X-Kvgate-Slo-Class"
Slo = tuple[str, SloClass]


def _lower(a: Priority, b: Priority) -> Priority:
    return a if ORDER.index(a) >= ORDER.index(b) else b


def slo_of(
    headers: Mapping[str, str], tenant: Tenant, s: AdmissionSettings, objective: str | None = None
) -> tuple[Slo | None, Tenant]:
    """The request's class (None: none) and its tenant with the class's priority applied (never
    higher than it was): the one its header names, else its InferenceObjective's
    (``objective``: the class the router maps the objective to), else its tenant's. Raises
    ValueError when the request asks for a class the tenant may not use."""
    asked = headers.get(SLO_HEADER, "").strip()[:64] or objective or ""
    name = tenant.slo_class
    if asked:
        cls = s.slo_classes.get(asked)
        allowed = (
            asked in tenant.slo_classes or asked == tenant.slo_class
            if tenant.slo_classes
            else cls is not None and ORDER.index(cls.priority) >= ORDER.index(tenant.priority)
        )
        if cls is None or not allowed:
            raise ValueError(f"SLO class {asked!r} is not available to this client")
        name = asked
    if name is None:
        return None, tenant
    cls = s.slo_classes[name]
    priority = _lower(cls.priority, tenant.priority)
    if priority != tenant.priority:
        tenant = tenant.model_copy(update={"priority": priority})
    return (name, cls), tenant


def expected_ttft_s(
    components: Mapping[str, float], prefill_weight: float, queue_weight: float
) -> float | None:
    """A routing candidate's expected time to first token from its cost components: its queue
    plus its own prefill (both without their weights); None when the policy gives no
    components."""
    if "queue_s" not in components or "prefill_s" not in components:
        return None
    queue = components["queue_s"] / queue_weight if queue_weight > 0 else 0.0
    pulled = components.get("pull_s", 0.0)  # a prefix's KV loaded from another node first
    return queue + pulled + components["prefill_s"] / max(prefill_weight, 1e-9)


def held(slo: Slo | None, components: Mapping[str, float], queue_weight: float) -> bool:
    """Whether a request of this class waits in the router: its best node has more queued ahead
    of it than the class's ``hold_queue_s``."""
    if slo is None or slo[1].hold_queue_s is None or "queue_s" not in components:
        return False
    queue = components["queue_s"] / queue_weight if queue_weight > 0 else 0.0
    return queue > slo[1].hold_queue_s


def late_refusal(
    slo: Slo | None,
    components: Mapping[str, float] | None,
    prefill_weight: float,
    queue_weight: float,
    waited_s: float,
    s: AdmissionSettings,
) -> Rejection | None:
    """:func:`deadline_refusal` of a request whose chosen node has these cost components."""
    if slo is None or components is None:
        return None
    ttft = expected_ttft_s(components, prefill_weight, queue_weight)
    return deadline_refusal(slo, ttft, waited_s, s)


def deadline_refusal(
    slo: Slo | None, ttft_s: float | None, waited_s: float, s: AdmissionSettings
) -> Rejection | None:
    """The refusal of a request that cannot meet its class's TTFT: what it waited for admission
    plus ``ttft_s`` (its best node's expected TTFT) past the target."""
    if slo is None or ttft_s is None or not s.deadline_refusal:
        return None
    name, cls = slo
    late = waited_s + ttft_s - cls.ttft_s
    if late <= 0:
        return None
    return Rejection(
        RejectReason.DEADLINE,
        True,
        retry_after(late, s),
        f"expected time to first token {waited_s + ttft_s:.1f} s exceeds the {name} "
        f"class's {cls.ttft_s:g} s",
    )
