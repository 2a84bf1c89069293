"""Tenant quota scenarios, run against each reservation store (in process: unit tests; Redis:
integration tests)."""

from __future__ import annotations

from admission.core import RejectReason
from admission.gate import AdmissionGate
from admission.reservations import ReservationStore
from admission.settings import AdmissionSettings, Tenant
from streams.schemas import LedgerEvent
from tests.factories import admit as gate_admit

ALPHA = Tenant(name="alpha", max_concurrency=2)
BETA = Tenant(name="beta", weight=1.0)
CAPPED = Tenant(name="capped", max_kv_share=0.25)
NODES = [500, 500]  # 1,000 KV blocks


def gate_on(store: ReservationStore) -> tuple[AdmissionGate, list[LedgerEvent]]:
    events: list[LedgerEvent] = []

    async def publish(ev: LedgerEvent) -> None:
        events.append(ev)

    settings = AdmissionSettings(
        queue_enabled=False,
        learn_output=False,
        tenants={"a": ALPHA, "b": BETA, "c": CAPPED},
    )
    return AdmissionGate(settings, "r", publish, store), events


async def admit(gate: AdmissionGate, rid: str, tenant: Tenant, prompt: int) -> RejectReason | None:
    v = await gate_admit(gate, rid, tenant, prompt, 16, 16, "default", NODES, 1.0, "m")
    return None if v.admitted else (v.rejection.reason if v.rejection else None)


async def concurrency_and_kv_share(store: ReservationStore) -> None:
    gate, events = gate_on(store)
    assert await admit(gate, "a1", ALPHA, 160) is None
    assert await admit(gate, "a2", ALPHA, 160) is None
    assert await admit(gate, "a3", ALPHA, 160) == RejectReason.TENANT_QUOTA  # 2 at a time
    assert await admit(gate, "b1", BETA, 160) is None  # others are not affected
    await gate.release("a1", 2.0)
    assert await admit(gate, "a4", ALPHA, 160) is None
    # 25 % of 1,000 blocks: 160-token prompts take 13 blocks each (with 16 output, × 1.1)
    taken = [await admit(gate, f"c{i}", CAPPED, 160) for i in range(25)]
    assert taken.count(None) == 250 // 13 and taken[-1] == RejectReason.TENANT_QUOTA
    assert (await store.tenant_usage("default"))["capped"] == (13 * (250 // 13), 250 // 13)
    assert {e.tenant for e in events if e.kind == "reserve"} == {"alpha", "beta", "capped"}
    for rid in list(gate.held):
        await gate.release(rid, 3.0)
    assert await store.tenant_usage("default") == {}
    assert await store.held("default") == (0, 0)


async def fair_share_when_contended(store: ReservationStore) -> None:
    """Alone, a tenant may fill the pool up to the watermarks (idle capacity is anyone's). Once
    another tenant asks, the flooder gets no more above yellow than its weighted share (1/2 of
    the 900 blocks its priority may reach), and the other gets the room as the flood drains."""
    gate, _ = gate_on(store)
    flooder = Tenant(name="beta")  # no caps of its own
    got = [await admit(gate, f"f{i}", flooder, 960) for i in range(20)]
    assert got.count(None) == 13 and got[-1] == RejectReason.RED_WATERMARK  # 68 blocks each
    # alpha asks while the pool is full: refused, but it now counts as a tenant with demand
    assert await admit(gate, "x1", ALPHA, 960) == RejectReason.RED_WATERMARK
    for i in range(5):  # some of the flood finishes: beta holds 8 × 68 = 544 blocks
        await gate.release(f"f{i}", 2.0)
    # below yellow beta may take idle room again (612, 680, 748 of 1,000) ...
    assert [await admit(gate, f"g{i}", flooder, 960) for i in range(3)] == [None] * 3
    # ... but not past yellow while alpha wants in: 816 > its share of 450
    assert await admit(gate, "g3", flooder, 960) == RejectReason.TENANT_QUOTA
    assert await admit(gate, "x2", ALPHA, 960) is None
    usage = await store.tenant_usage("default")
    assert usage == {"beta": (11 * 68, 11), "alpha": (68, 1)}
