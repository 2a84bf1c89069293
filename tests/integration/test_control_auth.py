"""Signed control messages, against a real broker and real router and agent processes: with
``kafka.control_keys`` set, the ``kvgate`` commands and the routers (pre-warm advice) sign, and
routers and agents apply only what is signed. A producer without the key — anyone who can write
to the topic — drains nothing. ``kvgate weights`` refuses a version already in use and ``kvgate
drain`` a node no agent reported (unless ``--force``), instead of reporting a success that
changes nothing."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from deploy.procs import Supervisor
from router.control import drain_message
from streams.kafka import KafkaBus
from streams.settings import KafkaSettings
from streams.topics import CONTROL
from tests.conftest import wait_until
from tests.integration.cluster import Cluster, get, kvgate_cli

pytestmark = pytest.mark.integration


def said(done: subprocess.CompletedProcess[str]) -> str:
    """The command's error, unwrapped from its box."""
    return " ".join(done.stderr.replace("│", " ").split())


async def test_only_signed_control_messages_apply(
    supervisor: Supervisor, kafka_settings: KafkaSettings
) -> None:
    supervisor.env["KVGATE_KAFKA__CONTROL_KEYS"] = json.dumps({"ops-2026": "a long secret"})
    _, url = await Cluster.two_nodes(supervisor)

    async def state() -> dict[str, Any]:
        got: dict[str, Any] = await get(url, "/v1/kvgate/state")
        return got

    assert (await state())["control"] == {"authenticated": True, "refused": {}}
    done = kvgate_cli(supervisor, "weights", "--version", "2", "--set", "prefill_weight=1.5")
    assert done.returncode == 0, done.stderr

    async def on_v2() -> bool:
        return bool((await state())["weights_version"] == 2)

    await wait_until(on_v2, 20, "the router on weights v2", 0.2)
    again = kvgate_cli(supervisor, "weights", "--version", "2", "--set", "prefill_weight=9")
    assert again.returncode != 0 and "not newer than 2" in said(again), again.stderr

    # someone with write access to the topic but no key: refused, nothing drained
    bus = KafkaBus(kafka_settings, "t-intruder")  # (the fixture's settings: no keys)
    await bus.start()
    try:
        forged = drain_message("n1", True)
        await bus.send(CONTROL, forged.subject, forged)
    finally:
        await bus.stop()

    async def refused() -> bool:
        return bool((await state())["control"]["refused"].get("unsigned"))

    await wait_until(refused, 20, "the unsigned drain refused", 0.2)
    assert (await state())["drained"] == []

    typo = kvgate_cli(supervisor, "drain", "n9")
    assert typo.returncode != 0 and "--force drains it anyway" in said(typo), typo.stderr
    assert kvgate_cli(supervisor, "drain", "n1").returncode == 0

    async def drained() -> bool:
        return bool((await state())["drained"] == ["n1"])

    await wait_until(drained, 20, "the signed drain applied", 0.2)
    forced = kvgate_cli(supervisor, "drain", "n9", "--force")
    assert forced.returncode == 0, forced.stderr
    wrong = kvgate_cli(supervisor, "canary", "v2", "--nodes", "n2,n8")
    assert wrong.returncode != 0 and "n8" in said(wrong), wrong.stderr
    assert kvgate_cli(supervisor, "canary", "v2", "--nodes", "n2").returncode == 0
    # what is in effect, with its age: the drains and the canary, not the refused or undone
    listed = kvgate_cli(supervisor, "control", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {r["subject"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert set(rows) == {"drain/n1", "drain/n9", "canary/v2", "weights/kvgate"}, rows
    assert all(r["signed"] and r["age_s"] >= 0 for r in rows.values())
    assert rows["canary/v2"]["payload"]["nodes"] == ["n2"]
    assert kvgate_cli(supervisor, "undrain", "n9").returncode == 0
    listed = kvgate_cli(supervisor, "control", "--json")
    assert "drain/n9" not in listed.stdout
