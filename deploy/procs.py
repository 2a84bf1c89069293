"""Starting and stopping kvgate's processes and the local Kafka and Redis (demo, tests, bench)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LocalInfra", "Proc", "Supervisor", "child_pids", "free_port"]

DEPLOY = Path(__file__).resolve().parent


_HANDED_OUT: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A port nothing listens on now, and never one this process handed out before: children
    bind their ports some time after they are chosen, and the kernel may offer a chosen but not
    yet bound port again. ``span``: the next ``span − 1`` ports are free and reserved too (an
    engine with data-parallel ranks binds its KV-event ports at port + rank)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        ports = range(port, port + span)
        if port + span > 65536 or any(p in _HANDED_OUT for p in ports):
            continue
        if all(_bindable(p) for p in ports[1:]):
            _HANDED_OUT.update(ports)
            return port


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Supervisor:
    """Child processes running ``python -m deploy <command>``, each with its own log file."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)

    @classmethod
    def isolated(cls, label: str, env: dict[str, str] | None = None) -> tuple[Supervisor, str]:
        """A supervisor whose children use a Kafka namespace of their own (``<label><hex>``,
        returned beside it), a fresh worker state directory and a free worker port, logging to a
        fresh temporary directory: a benchmark's run that shares nothing with another's."""
        namespace = f"{label}{uuid.uuid4().hex[:8]}"
        base = {
            "KVGATE_KAFKA__NAMESPACE": namespace,
            "KVGATE_WORKER__DATA_DIR": tempfile.mkdtemp(prefix=f"kvgate-{label}-worker-"),
            "KVGATE_WORKER__WEB_PORT": str(free_port()),
        }
        log_dir = Path(tempfile.mkdtemp(prefix=f"kvgate-{label}-"))
        return cls(log_dir, {**base, **(env or {})}), namespace

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        """``kvgate <args>`` (``python -m deploy``) as a child named ``name``."""
        return self.spawn_argv(name, [sys.executable, "-m", "deploy", *args], env=env)

    def spawn_argv(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Proc:
        """Any command as a child (e.g. a peer router to compare with), in ``cwd`` if given."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        full_env = {**os.environ, **self.env, **(env or {}), "PYTHONUNBUFFERED": "1"}
        with log.open("ab") as fh:
            popen = subprocess.Popen(  # noqa: S603 - a fixed argv, no shell
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs[name] = proc
        return proc

    def spawn_node(
        self,
        node_id: str,
        num_gpu_blocks: int | None = None,
        sglang: bool = False,
        model: str | None = None,
        engine_env: dict[str, str] | None = None,
        agent_env: dict[str, str] | None = None,
    ) -> str:
        """A simulated engine and its agent; returns the engine's base URL. ``sglang``: the
        engine looks like SGLang without KV events (SGLang metrics, approximate index)."""
        ranks = int((engine_env or {}).get("KVGATE_ENGINE__DATA_PARALLEL_SIZE", "1"))
        http_port, zmq_port, replay_port = free_port(), free_port(ranks), free_port(ranks)
        extra = ["--num-gpu-blocks", str(num_gpu_blocks)] if num_gpu_blocks else []
        if sglang:
            extra.append("--sglang")
        self.spawn(
            f"engine-{node_id}",
            "engine",
            "--port",
            str(http_port),
            "--kv-events-port",
            str(zmq_port),
            "--kv-events-replay-port",
            str(replay_port),
            *extra,
            env={
                **({"KVGATE_ENGINE__SERVED_MODEL_NAME": model} if model else {}),
                **(engine_env or {}),
            },
        )
        url = f"http://127.0.0.1:{http_port}"
        self.spawn(
            f"agent-{node_id}",
            "agent",
            "--node-id",
            node_id,
            "--engine-url",
            url,
            *(
                ["--engine-kind", "sglang", "--no-kv-events"]
                if sglang
                else [
                    "--kv-events",
                    f"tcp://127.0.0.1:{zmq_port}",
                    "--kv-events-replay",
                    f"tcp://127.0.0.1:{replay_port}",
                ]
            ),
            # the simulated engine keeps a session's KV between turns when asked to
            env={"KVGATE_AGENT__RETENTION_HINTS": "true", **(agent_env or {})},
        )
        return url

    def kill(self, name: str, sig: int = signal.SIGKILL, wait_s: float = 30.0) -> None:
        proc = self.procs.pop(name)
        if proc.alive():
            proc.popen.send_signal(sig)
            try:
                proc.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def stop_all(self, wait_s: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        for proc in self.procs.values():
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        self.procs.clear()


@dataclass
class LocalInfra:
    """The repo's launchers for Kafka (KRaft) and Redis; stops only what it started."""

    kafka_port: int = 19092
    redis_port: int = 16379
    started: list[str] = field(default_factory=list)

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "KVGATE_KAFKA_PORT": str(self.kafka_port),
            "KVGATE_KAFKA_CONTROLLER_PORT": str(self.kafka_port + 1),
            "KVGATE_REDIS_PORT": str(self.redis_port),
        }

    @classmethod
    def from_settings(cls, bootstrap_servers: str, redis_url: str) -> LocalInfra:
        """Ports from the settings (``host:port`` of the first broker, ``redis://host:port/db``)."""
        kafka_port = int(bootstrap_servers.split(",")[0].rsplit(":", 1)[1])
        redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        return cls(kafka_port=kafka_port, redis_port=redis_port)

    def run(self, which: str, action: str) -> subprocess.CompletedProcess[bytes]:
        """Run a launcher action (``start``, ``stop``, ``status``) for ``kafka`` or ``redis``."""
        return self._script(which, action)

    def _script(self, which: str, action: str) -> subprocess.CompletedProcess[bytes]:
        script = DEPLOY / ("kafka/kafka.sh" if which == "kafka" else "local/redis.sh")
        return subprocess.run(  # noqa: S603 - the repo's own launcher
            ["/bin/bash", str(script), action],
            env=self._env(),
            capture_output=True,
            check=False,
        )

    def up(self, which: str) -> None:
        if self._script(which, "status").returncode == 0:
            return
        res = self._script(which, "start")
        if res.returncode != 0:
            raise RuntimeError(
                f"{which} failed to start:\n{res.stdout.decode()}{res.stderr.decode()}"
            )
        self.started.append(which)

    def down(self) -> None:
        for which in reversed(self.started):
            self._script(which, "stop")
        self.started.clear()
