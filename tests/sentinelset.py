"""A Sentinel-managed Redis for tests and the chaos benchmark: a primary, a replica of it and
one Sentinel (quorum 1) that promotes the replica a second after the primary stops answering.
The processes are the supervisor's children (``redis-primary``, ``redis-replica``,
``redis-sentinel``); ``redis-server --sentinel`` is the Sentinel (the OS package's
``redis-sentinel`` is the same binary)."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from deploy.procs import Supervisor, free_port

SERVICE = "kvgate"


def _server(port: int, home: Path, *extra: str) -> list[str]:
    return [
        "redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
        "--appendonly", "no", "--dir", str(home), *extra,
    ]  # fmt: skip


@dataclass
class SentinelSet:
    sup: Supervisor
    home: Path
    down_after_ms: int = 1000

    def __post_init__(self) -> None:
        self.primary_port, self.replica_port, self.sentinel_port = (free_port() for _ in "abc")

    @property
    def sentinels(self) -> list[str]:
        return [f"127.0.0.1:{self.sentinel_port}"]

    def env(self) -> dict[str, str]:
        """A router's settings for this set (``KVGATE_REDIS__*``)."""
        return {
            "KVGATE_REDIS__SENTINELS": f'["{self.sentinels[0]}"]',
            "KVGATE_REDIS__SENTINEL_SERVICE": SERVICE,
            "KVGATE_REDIS__URL": "redis://127.0.0.1:1/0",  # its database only: never dialled
        }

    def start(self, timeout_s: float = 20.0) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.sup.spawn_argv("redis-primary", _server(self.primary_port, self.home))
        replica = ["--replicaof", "127.0.0.1", str(self.primary_port)]
        self.sup.spawn_argv("redis-replica", _server(self.replica_port, self.home, *replica))
        conf = self.home / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.home}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self.sup.spawn_argv("redis-sentinel", ["redis-server", str(conf), "--sentinel"])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # the Sentinel learns of replicas from the primary's INFO (every 10 s): until it
            # lists this one, a dead primary has nobody to be replaced by
            if (
                self.primary() == self.primary_port
                and self._replicated()
                and self._sentinel_knows_replica()
            ):
                return
            time.sleep(0.1)
        raise TimeoutError("the Sentinel-managed Redis did not come up")

    def _sentinel_knows_replica(self) -> bool:
        try:
            with Redis(port=self.sentinel_port, socket_timeout=1.0) as s:
                replicas = s.execute_command("SENTINEL", "replicas", SERVICE)
        except RedisError:
            return False
        for raw in replicas or ():  # (redis-py parses each into a dict; raw: a flat list)
            fields = raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2], strict=False))
            fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
            port, flags = fields.get("port"), fields.get("flags", "")
            flags = flags.decode() if isinstance(flags, bytes) else str(flags)
            if port is not None and int(port) == self.replica_port and "down" not in flags:
                return True
        return False

    def primary(self) -> int | None:
        """The primary's port as the Sentinel names it (None: it cannot be asked)."""
        try:
            with Redis(port=self.sentinel_port, socket_timeout=1.0) as s:
                got = s.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
        except RedisError:
            return None
        return int(got[1]) if got else None

    def _replicated(self) -> bool:
        try:
            with Redis(port=self.replica_port, socket_timeout=1.0) as r:
                return r.info("replication").get("master_link_status") == "up"
        except RedisError:
            return False

    def kill_primary(self) -> None:
        self.sup.kill("redis-primary", signal.SIGKILL)

    def wait_failover(self, timeout_s: float = 30.0) -> float:
        """Seconds until the Sentinel names the replica the primary."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.primary() == self.replica_port:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise TimeoutError("the Sentinel did not fail over")

    def client(self) -> Redis:
        """A client of whichever server is the primary now."""
        return Redis(port=self.primary() or self.primary_port, socket_timeout=1.0)
