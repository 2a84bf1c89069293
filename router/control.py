"""Runtime control of a router from ``kvgate.control``.

Every router replica follows the whole (compacted) control topic from the beginning, without a
consumer group, so that all replicas converge on the same weights and a restarted router picks up
the latest ones before it serves. ``weights`` messages (subject ``weights/<policy>``) carry the
full weight set of one policy with a ``version``; a router applies them when the policy is the one
it runs and the version is newer than its own. Invalid weights are refused (logged and counted),
never half-applied; malformed messages go to the dead-letter topic. With ``kafka.control_keys``
set only signed messages apply, and per subject only one newer than the last applied
(streams/controlauth.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from router.decision.fleet import Fleet
from router.decision.policies.canary import WeightsCanary, apply_weights_canary
from router.decision.types import Policy
from streams.background import Background
from streams.controlauth import ControlAuth
from streams.kafka import KafkaBus, decode_or_dead_letter, make_consumer
from streams.schemas import ControlMessage
from streams.settings import KafkaSettings
from streams.topics import CONTROL

__all__ = [
    "ControlFollower",
    "apply_weights",
    "canary_message",
    "drain_message",
    "weights_message",
]

log = logging.getLogger(__name__)


def weights_message(
    policy: str, weights: dict[str, Any], now: float | None = None
) -> ControlMessage:
    """The control message that sets ``policy``'s weights on every router."""
    return ControlMessage(
        subject=f"weights/{policy}",
        kind="weights",
        ts=now or time.time(),
        payload={"policy": policy, "weights": weights},
    )


def drain_message(node: str, drain: bool, now: float | None = None) -> ControlMessage:
    """The control message that drains (or undrains) ``node`` on every router: no new requests
    go to a draining node, its in-flight requests finish. One subject per node, so that the
    compacted topic keeps only its latest state."""
    return ControlMessage(
        subject=f"drain/{node}",
        kind="drain" if drain else "undrain",
        ts=now or time.time(),
        payload={"node": node},
    )


def canary_message(
    group: str, nodes: list[str], share: float, now: float | None = None
) -> ControlMessage:
    """The control message that sends ``share`` of requests to ``nodes`` (and only that share)
    on every router; no nodes or a share of 0 ends the canary. One subject per group."""
    return ControlMessage(
        subject=f"canary/{group}",
        kind="canary",
        ts=now or time.time(),
        payload={"group": group, "nodes": nodes, "share": share},
    )


def apply_canary(fleet: Fleet, msg: ControlMessage) -> str:
    """Apply a ``canary`` message: ``applied``, ``ended`` or ``invalid: ...``."""
    group, nodes, share = (msg.payload.get(k) for k in ("group", "nodes", "share"))
    if not isinstance(group, str) or not group or msg.subject != f"canary/{group}":
        return "invalid: a canary message names its group as canary/<group>"
    if not isinstance(nodes, list) or not all(isinstance(n, str) and n for n in nodes):
        return "invalid: payload.nodes must be a list of node ids"
    if len(nodes) > 10_000:
        return "invalid: payload.nodes is too long"
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
        return "invalid: payload.share must be a number in [0, 1]"
    fleet.set_canary(group, nodes, float(share))
    return "applied" if group in fleet.canaries else "ended"


def apply_weights(policy: Policy | WeightsCanary, msg: ControlMessage) -> str:
    """Apply a ``weights`` message to ``policy``; returns what happened (for logs and tests):
    ``applied``, ``other_policy``, ``not_newer``, ``invalid: ...`` or ``fixed_policy``."""
    if msg.payload.get("policy") != policy.name:
        return "other_policy"
    setter: Callable[[dict[str, Any]], None] | None = getattr(policy, "set_weights_from", None)
    if setter is None:
        return "fixed_policy"
    raw = msg.payload.get("weights")
    if not isinstance(raw, dict):
        return "invalid: payload.weights must be an object"
    version = raw.get("version")
    if not isinstance(version, int) or version <= policy.weights_version:
        return "not_newer"
    try:
        setter(raw)
    except (ValidationError, ValueError, TypeError) as exc:
        return f"invalid: {exc}".splitlines()[0]
    return "applied"


class ControlFollower(Background):
    """Follows ``kvgate.control`` and applies what concerns this router."""

    def __init__(
        self,
        kafka: KafkaSettings,
        bus: KafkaBus,
        policy: Policy | WeightsCanary,
        client_id: str,
        fleet: Fleet,
    ) -> None:
        self.kafka = kafka
        self.bus = bus
        self.policy = policy
        self.client_id = client_id
        self.fleet = fleet  # drains and canaries land here (kvgate drain / kvgate canary)
        self.topic = CONTROL.name(kafka.namespace)
        self.applied = 0
        self.refused = 0
        # only signed messages where keys are set, each newer than its subject's last
        self.auth = ControlAuth(kafka.control_keys, kafka.control_key_id)
        self.refusals: Counter[str] = Counter()  # unsigned, bad_signature, unknown_key, stale
        if not self.auth.enabled:
            log.warning(
                "kafka.control_keys not set: control messages are not authenticated (anyone "
                "who can write to %s can drain nodes and set weights)",
                self.topic,
            )
        self.caught_up = asyncio.Event()
        # an autoscaler's scale messages (model, desired replicas) go here: a model asked to
        # scale up from zero has requests wait for its first node (router/flow/scaleroom.py)
        self.on_scale: Callable[[str, int], None] | None = None

    def handle(self, msg: ControlMessage) -> str:
        why = self.auth.check(msg)
        if why is not None:
            self.refused += 1
            self.refusals[why] += 1
            log.warning("refused control message %s (%s): %s", msg.subject, msg.kind, why)
            return f"refused: {why}"
        outcome = "ignored"
        if msg.kind in ("drain", "undrain"):
            node = msg.payload.get("node")
            if not isinstance(node, str) or not node or msg.subject != f"drain/{node}":
                self.refused += 1
                return "invalid: a drain message names its node as drain/<node>"
            if msg.kind == "drain":
                self.fleet.drained.add(node)
            else:
                self.fleet.drained.discard(node)
            log.info("node %s %sed", node, msg.kind)
            return msg.kind + "ed"
        if msg.kind == "canary":
            outcome = apply_canary(self.fleet, msg)
            if outcome.startswith("invalid"):
                self.refused += 1
                log.warning("refused canary %s: %s", msg.subject, outcome)
            else:
                log.info("canary %s %s: %s", msg.subject, outcome, msg.payload)
            return outcome
        if msg.kind == "scale":
            model, desired = msg.payload.get("model"), msg.payload.get("desired_replicas")
            if (
                not isinstance(model, str)
                or not 0 < len(model) <= 256
                or isinstance(desired, bool)
                or not isinstance(desired, int)
                or not 0 <= desired <= 100_000
            ):
                self.refused += 1
                return "invalid: a scale message names its model and desired_replicas"
            if self.on_scale is not None:
                self.on_scale(model, desired)
            return "scaled"
        if msg.kind == "weights" and msg.subject.startswith("weights-canary/"):
            if not isinstance(self.policy, WeightsCanary):
                return "ignored"
            outcome = apply_weights_canary(self.policy, msg)
            if outcome.startswith("invalid"):
                self.refused += 1
                log.warning("refused weights canary %s: %s", msg.subject, outcome)
            elif outcome != "other_policy":
                log.info("weights canary %s: %s", msg.subject, self.policy.state())
            return outcome
        if msg.kind == "weights":
            outcome = apply_weights(self.policy, msg)
            if outcome == "applied":
                if isinstance(self.policy, WeightsCanary):
                    self.policy.promoted()
                self.applied += 1
                log.info(
                    "weights of %s now version %d", self.policy.name, self.policy.weights_version
                )
            elif outcome.startswith("invalid"):
                self.refused += 1
                log.warning("refused weights for %s: %s", self.policy.name, outcome)
        return outcome

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
            except Exception as exc:  # the router keeps serving on its current weights
                self.failures += 1
                self.failing = f"{type(exc).__name__}: {exc}"[:300]
                log.warning("control follower restarting after %s", exc)
                await asyncio.sleep(1.0)

    async def _follow(self) -> None:
        from aiokafka import TopicPartition

        consumer = make_consumer(
            self.kafka, group_id=None, client_id=self.client_id, **self.kafka.follow_options()
        )
        await consumer.start()
        try:
            parts = None
            for _ in range(300):
                parts = consumer.partitions_for_topic(self.topic)
                if parts:
                    break
                await consumer._client.force_metadata_update()
                await asyncio.sleep(0.1)
            if not parts:
                raise RuntimeError(f"topic {self.topic} does not exist")
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            end = await consumer.end_offsets(tps)
            while True:
                batches = await consumer.getmany(timeout_ms=200)
                self.running_again()
                for records in batches.values():
                    for record in records:
                        if record.value is None:
                            continue
                        msg = await decode_or_dead_letter(
                            self.bus, CONTROL, record, f"router:{self.client_id}"
                        )
                        if isinstance(msg, ControlMessage):
                            self.handle(msg)
                if not self.caught_up.is_set() and all(
                    await asyncio.gather(*(self._at(consumer, tp, end[tp]) for tp in tps))
                ):
                    self.caught_up.set()
        finally:
            await consumer.stop()

    @staticmethod
    async def _at(consumer: Any, tp: Any, end: int) -> bool:
        return bool(await consumer.position(tp) >= end)
