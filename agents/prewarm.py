"""Pre-warm advice: a hot prefix the routers want computed on this node before it is asked for.

The agent follows ``kvgate.control`` from its end; advice naming its node makes the engine compute
the prefix (a one-token completion on its token ids), so the next request there hits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp

from agents.settings import AgentSettings
from streams.codec import decode
from streams.controlauth import ControlAuth
from streams.exceptions import SchemaError
from streams.kafka import KafkaBus, make_consumer
from streams.schemas import ControlMessage
from streams.topics import CONTROL

__all__ = ["Prewarmer"]

log = logging.getLogger(__name__)


class Prewarmer:
    def __init__(self, settings: AgentSettings, bus: KafkaBus, headers: Mapping[str, str]) -> None:
        self.settings = settings
        self.bus = bus
        self.headers = dict(headers)  # the engine's auth and data-parallel rank
        self.prewarmed = 0
        self.refused = 0  # advice not signed with a control key (where keys are set)
        self.auth = ControlAuth(bus.settings.control_keys, bus.settings.control_key_id)

    async def run(self, http: aiohttp.ClientSession) -> None:
        """Follow kvgate.control from its end until cancelled."""
        topic = CONTROL.name(self.bus.settings.namespace)
        while True:
            consumer = make_consumer(
                self.bus.settings,
                topic,
                group_id=None,
                client_id=f"agent-{self.settings.node_id}-control",
                auto_offset_reset="latest",
            )
            try:
                await consumer.start()
                async for record in consumer:
                    if record.value is None:  # a tombstone (advice withdrawn by compaction)
                        continue
                    try:
                        msg = decode(ControlMessage, record.value or b"")
                    except SchemaError:
                        continue  # the routers dead-letter malformed control messages
                    if msg.kind != "prewarm" or self.settings.node_id not in msg.payload.get(
                        "nodes", ()
                    ):
                        continue
                    why = self.auth.check(msg)
                    if why is not None:  # someone other than a router asks the engine to work
                        self.refused += 1
                        log.warning("refused pre-warm advice %s: %s", msg.subject, why)
                        continue
                    await self.warm(http, msg)
            except Exception as exc:  # keep heartbeats going whatever happens here
                log.warning("pre-warm follower restarting after %s", exc)
                await asyncio.sleep(1.0)
            finally:
                await consumer.stop()

    async def warm(self, http: aiohttp.ClientSession, msg: ControlMessage) -> None:
        body = {
            "model": msg.payload.get("model"),
            "prompt": msg.payload.get("prompt_token_ids", []),
            "max_tokens": 1,
        }
        salt = msg.payload.get("cache_salt")
        if isinstance(salt, str) and salt:
            body["cache_salt"] = salt  # the tenant's prefix, salted as its requests are
        try:
            async with http.post(
                f"{self.settings.engine_url}/v1/completions",
                json=body,
                headers=self.headers,
            ) as r:
                await r.read()
                if r.status == 200:
                    self.prewarmed += 1
                else:
                    log.warning("pre-warm refused by the engine: HTTP %d", r.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("pre-warm failed: %s", exc)
