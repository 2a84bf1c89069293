"""The router's HTTP clients to its engines, open while the router runs: the proxy's kept-alive
pools (router/wire/client.py: the hot path), one aiohttp session for the prefill leg, the
pass-through and the probes; and the headers engines started with an API key want on every
``/v1`` call."""

from __future__ import annotations

import aiohttp

from router.flow.refusals import Refusal
from router.settings import RouterSettings
from router.wire.client import Pools

__all__ = ["Upstream"]


class Upstream:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        key = settings.upstream_api_key
        # engines started with --api-key (vLLM) want it on every /v1 call
        self._auth = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        self._session: aiohttp.ClientSession | None = None
        self._pools: Pools | None = None

    @property
    def auth(self) -> dict[str, str]:
        """Headers engines started with an API key want (empty without one)."""
        return dict(self._auth)

    @property
    def open(self) -> bool:
        return self._session is not None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pool; a 503 while the router is starting."""
        if self._session is None:
            raise Refusal(503, "the router is starting", "service_unavailable")
        return self._session

    @property
    def pools(self) -> Pools:
        """The proxy's pools; a 503 while the router is starting."""
        if self._pools is None:
            raise Refusal(503, "the router is starting", "service_unavailable")
        return self._pools

    def start(self) -> None:
        """Open the pool (on the event loop, at the router's start): no total time limit (a
        stream lasts as long as ``router.max_stream_s`` lets it), bounded connect and idle
        reads, bodies passed on as the engine encoded them."""
        s = self.settings
        timeout = aiohttp.ClientTimeout(
            total=None, connect=s.upstream_connect_timeout_s, sock_read=s.upstream_idle_timeout_s
        )
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
        )
        self._pools = Pools(s.upstream_connect_timeout_s, s.upstream_idle_timeout_s)

    async def close(self) -> None:
        if self._pools is not None:
            await self._pools.close()
        if self._session is not None:
            await self._session.close()
