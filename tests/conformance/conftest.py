"""The picker under test: kvgate's endpoint picker in front of two simulated engines.

Another picker plugs in by yielding its own :class:`Target` from ``picker``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from router.epp import host_port
from tests.edgekit import GATEWAY
from tests.eppkit import outcomes, picker_on

SHEDDABLE_OBJECTIVE = "batch-jobs"  # an InferenceObjective of sheddable priority
CRITICAL_KEY = "sk-critical"  # clients allowed to run at critical priority
HOLDER_KEY = "sk-holder"


@dataclass
class Target:
    """What the suite needs of a picker: a channel to it, the gRPC call metadata it wants, the
    pool's endpoints (``host:port``), and hooks to make the pool unready, to load it heavily
    (``load``: returns how to end the load), and to read which endpoint it accounted the last
    request to."""

    channel: Any
    call_metadata: tuple[tuple[str, str], ...]
    pool: list[str]
    unready: Callable[[], Awaitable[None]]
    last_served: Callable[[], Awaitable[str]]
    api_key: str = "sk-alpha"
    critical_key: str = CRITICAL_KEY
    holder_key: str = HOLDER_KEY  # another critical client, whose requests load the pool
    sheddable_objective: str = SHEDDABLE_OBJECTIVE
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
async def picker() -> AsyncIterator[Target]:
    tenants = {
        "sk-alpha": {"name": "alpha", "priority": "normal"},
        CRITICAL_KEY: {"name": "critical", "priority": "high"},
        HOLDER_KEY: {"name": "holder", "priority": "high"},
    }
    router = {"objective_priorities": {SHEDDABLE_OBJECTIVE: "low"}, "epp_fallbacks": 1}
    async with picker_on(admission={"tenants": tenants}, router=router) as (e, channel, _):
        by_endpoint = {host_port(url): node for node, url in e.engines.items()}

        async def unready() -> None:
            e.overrides = {n: {"healthy": False} for n in e.engines}
            await asyncio.sleep(0.6)  # (the next heartbeats say so)

        async def last_served() -> str:
            node = outcomes(e)[-1].node_id
            return next(ep for ep, n in by_endpoint.items() if n == node)

        yield Target(
            channel,
            (("x-kvgate-gateway-key", GATEWAY),),
            sorted(by_endpoint),
            unready,
            last_served,
            extra={"edge": e},
        )
