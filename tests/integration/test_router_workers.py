"""``kvgate router --workers 2``: two whole routers on one port (SO_REUSEPORT), each with its own
admin listener; requests through the shared port are served by both; a worker killed -9 is
restarted; SIGTERM to the supervisor stops them all."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import aiohttp
import pytest

from deploy.procs import Supervisor, child_pids, free_port
from tests.conftest import REDIS, wait_until
from tests.integration.cluster import MODEL, Cluster, get, post

pytestmark = pytest.mark.integration


async def health(url: str) -> dict[str, str] | None:
    try:
        return dict(await get(url, "/health"))
    except (aiohttp.ClientError, OSError):
        return None


async def test_two_workers_share_the_port_restart_and_stop(supervisor: Supervisor) -> None:
    admin = free_port(span=2)
    # several routers share one budget through Redis (in-process stores are refused)
    supervisor.env.update({"KVGATE_ADMISSION__BACKEND": "redis", "KVGATE_REDIS__URL": REDIS})
    c = Cluster(supervisor)
    c.add_engine("n1")
    c.add_worker()
    url = c.add_router(
        "router",
        env={"KVGATE_ROUTER__WORKERS": "2", "KVGATE_ROUTER__ADMIN_PORT": str(admin)},
    )
    await c.wait_ready("router", 1)
    admins = [f"http://127.0.0.1:{admin + i}" for i in range(2)]

    async def both_ready() -> bool:
        for a in admins:
            try:
                if not (await get(a, "/ready"))["ready"]:
                    return False
            except (aiohttp.ClientError, OSError):
                return False
        return True

    await wait_until(both_ready, 90.0, "both workers ready", 0.25)
    assert [(await health(a) or {}).get("router_id") for a in admins] == [
        "router-w0",
        "router-w1",
    ]

    # fresh connections through the shared port reach both workers, and both serve requests
    served: set[str] = set()
    for i in range(40):
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:
            async with http.get(url + "/health") as r:
                served.add((await r.json())["router_id"])
            body = {"model": MODEL, "prompt": f"worker test {i}", "max_tokens": 2}
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        if served == {"router-w0", "router-w1"} and i >= 10:
            break
    assert served == {"router-w0", "router-w1"}
    status, _ = await post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert status == 200

    # a worker killed -9 comes back on its admin port (a new process)
    parent = supervisor.procs["router"].pid
    before = set(child_pids(parent))
    assert len(before) == 2
    os.kill(sorted(before)[0], signal.SIGKILL)

    async def replaced() -> bool:
        now = set(child_pids(parent))
        return len(now) == 2 and now != before and await both_ready()

    await wait_until(replaced, 90.0, "the killed worker restarted and ready", 0.25)

    # SIGTERM to the supervisor: every worker stops cleanly, the supervisor exits 0
    workers = child_pids(parent)
    supervisor.procs["router"].popen.send_signal(signal.SIGTERM)
    assert supervisor.procs["router"].popen.wait(timeout=45) == 0
    assert not [p for p in workers if Path(f"/proc/{p}").exists()]
