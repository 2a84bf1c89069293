"""``kvgate weights``, ``drain``, ``undrain`` and ``canary``: control messages to every router.

Before it publishes, a command reads what ``kvgate.control`` holds already: a weights version must
be newer than the last published for the policy (a version used once is refused, as routers
would ignore it and the command would report a success that changes nothing), and every message
gets a timestamp past the last one of its subject (routers apply only newer ones). ``drain``
refuses a node that sent no heartbeat for :data:`KNOWN_WITHIN_S` unless ``--force``: a typo
would otherwise drain nothing and report success. With ``kafka.control_keys`` set the bus signs
each message (streams/controlauth.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from deploy.cli import ConfigOpt, _settings, app
from deploy.settings import Settings
from streams.schemas import ControlMessage

__all__ = ["canary", "drain", "undrain", "weights"]

KNOWN_WITHIN_S = 300.0  # a node known to drain: a heartbeat within this long


async def _read_all(s: Settings, topic: str, since_ms: int | None = None) -> list[Any]:
    """Every record of ``topic`` (from ``since_ms``, else its beginning) up to its end now."""
    from aiokafka import TopicPartition

    from streams.kafka import make_consumer

    consumer = make_consumer(s.kafka, group_id=None, client_id="kvgate-cli-reader")
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(topic)
        for _ in range(50):
            if parts:
                break
            await consumer._client.force_metadata_update()
            await asyncio.sleep(0.1)
            parts = consumer.partitions_for_topic(topic)
        if not parts:
            return []
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        end = await consumer.end_offsets(tps)
        if since_ms is None:
            await consumer.seek_to_beginning(*tps)
        else:
            found = await consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
            for tp in tps:
                at = found.get(tp)
                consumer.seek(tp, at.offset if at is not None else end[tp])
        out: list[Any] = []
        pending = {tp for tp in tps if await consumer.position(tp) < end[tp]}
        while pending:
            batches = await consumer.getmany(*pending, timeout_ms=1000)
            for records in batches.values():
                out.extend(records)
            pending = {tp for tp in pending if await consumer.position(tp) < end[tp]}
        return out
    finally:
        await consumer.stop()


async def _latest(s: Settings) -> dict[str, ControlMessage]:
    """The last message of every subject on kvgate.control."""
    from streams.codec import decode
    from streams.exceptions import SchemaError
    from streams.topics import CONTROL

    out: dict[str, ControlMessage] = {}
    for record in await _read_all(s, CONTROL.name(s.kafka.namespace)):
        if record.value is None:
            continue
        try:
            msg = decode(ControlMessage, record.value)
        except SchemaError:
            continue
        out[msg.subject] = msg
    return out


async def _known_nodes(s: Settings) -> set[str]:
    """Nodes whose agents sent a heartbeat within :data:`KNOWN_WITHIN_S`."""
    from streams.topics import HEARTBEATS

    since = int((time.time() - KNOWN_WITHIN_S) * 1000)
    records = await _read_all(s, HEARTBEATS.name(s.kafka.namespace), since)
    return {r.key.decode("utf-8", "replace") for r in records if r.key is not None}


def _send_control(s: Settings, msg: ControlMessage, check: Any = None) -> None:
    """Publish ``msg`` on kvgate.control (acknowledged by the broker) with a timestamp past the
    last of its subject; ``check(latest)`` may refuse it first (a ``typer.BadParameter``)."""
    from streams.kafka import KafkaBus, ensure_topics
    from streams.topics import CONTROL

    async def publish() -> None:
        await ensure_topics(s.kafka)
        latest = await _latest(s)
        if check is not None:
            await check(latest)
        last = latest.get(msg.subject)
        ts = max(msg.ts, last.ts + 0.001) if last is not None else msg.ts
        bus = KafkaBus(s.kafka, "kvgate-cli")
        await bus.start()
        try:
            await bus.send(CONTROL, msg.subject, msg.model_copy(update={"ts": ts}))
        finally:
            await bus.stop()

    asyncio.run(publish())


@app.command()
def weights(
    version: Annotated[int, typer.Option(help="new weights version (must be newer)")],
    policy: Annotated[str | None, typer.Option(help="policy (default: the config's)")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="NAME=VALUE over the config's weights")
    ] = None,
    canary: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="only this share of requests (by session) gets the weights, the rest keep "
            "theirs; 0 ends the canary",
        ),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Publish new policy weights on kvgate.control: every router applies them at runtime and
    records the version with each decision. With --canary, they decide only that share of the
    requests (compare the two versions in Grafana), until a plain `kvgate weights` replaces the
    current ones or --canary 0 ends it."""
    from router.control import weights_message
    from router.decision.policies.canary import weights_canary_message

    s = _settings(config)
    name = policy or s.router.policy
    model = {"kvgate": s.router.cost, "seed_score": s.router.weights}.get(name)
    if model is None:
        raise typer.BadParameter(f"policy {name!r} has no runtime weights (kvgate, seed_score)")
    values: dict[str, object] = model.model_dump()
    for item in set_ or []:
        key, sep, raw = item.partition("=")
        if not sep or key not in values:
            raise typer.BadParameter(
                f"--set {item!r}: expected NAME=VALUE, NAME one of {sorted(values)}"
            )
        values[key] = raw
    values["version"] = version
    try:
        checked = type(model).model_validate(values).model_dump()
    except Exception as exc:
        raise typer.BadParameter(str(exc)) from exc

    async def newer(latest: dict[str, ControlMessage]) -> None:
        # the current weights' version (a canary's version may be promoted: it is not current)
        current = latest.get(f"weights/{name}")
        if current is None:
            return
        try:
            used = int(
                type(model).model_validate(current.payload["weights"]).model_dump()["version"]
            )
        except Exception:  # weights every router refused: not in use
            return
        if version <= used:
            raise typer.BadParameter(
                f"version {version} of {name}'s weights is not newer than {used}, the current "
                "one: routers would ignore it",
                param_hint="--version",
            )

    if canary is not None:
        _send_control(s, weights_canary_message(name, checked, canary), newer)
        typer.echo(json.dumps({"policy": name, "weights": checked, "canary_share": canary}))
        return
    _send_control(s, weights_message(name, checked), newer)
    typer.echo(json.dumps({"policy": name, "weights": checked}))


def _publish_drain(config: Path | None, node: str, drain: bool, force: bool = True) -> None:
    from router.control import drain_message

    s = _settings(config)

    async def known(_: dict[str, ControlMessage]) -> None:
        if not force and node not in await _known_nodes(s):
            raise typer.BadParameter(
                f"no node {node!r} sent a heartbeat in the last {KNOWN_WITHIN_S:g} s (a typo?); "
                "--force drains it anyway",
                param_hint="NODE",
            )

    _send_control(s, drain_message(node, drain), known)
    typer.echo(json.dumps({"node": node, "draining": drain}))


@app.command()
def drain(
    node: Annotated[str, typer.Argument(help="the node id (as its agent names it)")],
    force: Annotated[
        bool, typer.Option("--force", help="drain a node that sent no recent heartbeat")
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Drain a node on every router (kvgate.control): no new requests; streams still running
    there after router.drain_grace_s go on from other nodes, the rest finish."""
    _publish_drain(config, node, True, force)


@app.command()
def undrain(
    node: Annotated[str, typer.Argument(help="the node id")],
    config: ConfigOpt = None,
) -> None:
    """Take a node back into routing on every router."""
    _publish_drain(config, node, False)


@app.command()
def canary(
    group: Annotated[str, typer.Argument(help="the canary group's name, e.g. vllm-0.34")],
    nodes: Annotated[
        str, typer.Option(help="comma-separated node ids of the group (empty: end it)")
    ] = "",
    share: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="of requests sent to the group, and only it")
    ] = 0.05,
    off: Annotated[bool, typer.Option("--off", help="end the canary")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="name nodes that sent no recent heartbeat")
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Send a share of requests to a group of nodes (e.g. 5 % to a new engine version) on every
    router (kvgate.control); the other requests avoid the group."""
    from router.control import canary_message

    members = [] if off else [n.strip() for n in nodes.split(",") if n.strip()]
    if not off and not members:
        raise typer.BadParameter("--nodes names the group's nodes (or --off ends the canary)")
    s = _settings(config)

    async def known(_: dict[str, ControlMessage]) -> None:
        unknown = sorted(set(members) - await _known_nodes(s)) if members and not force else []
        if unknown:
            raise typer.BadParameter(
                f"no heartbeat from {', '.join(unknown)} in the last {KNOWN_WITHIN_S:g} s (a "
                "typo?); --force names them anyway",
                param_hint="--nodes",
            )

    _send_control(s, canary_message(group, members, 0.0 if off else share), known)
    typer.echo(json.dumps({"group": group, "nodes": members, "share": 0.0 if off else share}))


@app.command("control")
def control_state(
    json_output: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False,
    config: ConfigOpt = None,
) -> None:
    """What kvgate.control holds now, as every router (also one started later) applies it:
    drains, canaries and weights with their age. Undo a drain with `kvgate undrain NODE`, a
    canary with `kvgate canary GROUP --off`. (Pre-warm advice is counted, not listed.)"""
    s = _settings(config)
    latest = asyncio.run(_latest(s))
    now = time.time()
    prewarm = 0
    rows: list[dict[str, Any]] = []
    for subject, msg in sorted(latest.items()):
        if msg.kind == "prewarm":
            prewarm += 1
            continue
        if msg.kind == "undrain" or (msg.kind == "canary" and not msg.payload.get("nodes")):
            continue  # undone: nothing in effect
        rows.append(
            {
                "subject": subject,
                "kind": msg.kind,
                "age_s": round(now - msg.ts, 1),
                "signed": msg.signature is not None,
                "payload": msg.payload,
            }
        )
    if json_output:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    for row in rows:
        age = row["age_s"]
        when = f"{age / 3600:.1f} h" if age >= 3600 else f"{age:.0f} s"
        typer.echo(f"{row['subject']:<40} {row['kind']:<8} {when:>8} ago  {row['payload']}")
    typer.echo(f"({len(rows)} in effect; {prewarm} pre-warm advice)")
