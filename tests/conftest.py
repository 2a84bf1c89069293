"""Shared fixtures. Integration tests need the Kafka and Redis that `.ci/run` starts
(``KVGATE_TEST_KAFKA``, default 127.0.0.1:19092; ``KVGATE_TEST_REDIS``, default
redis://127.0.0.1:16379/0). Each test gets its own topic namespace and Faust app id."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# every record kvgate renders without the model (streams/trusted.py) is checked against it,
# here and in the processes the tests start
os.environ["KVGATE_CHECK_RECORDS"] = "1"

import streams.trusted
from deploy.procs import Supervisor, free_port
from streams.settings import KafkaSettings, WorkerSettings

streams.trusted.CHECK = True

KAFKA = os.environ.get("KVGATE_TEST_KAFKA", "127.0.0.1:19092")
REDIS = os.environ.get("KVGATE_TEST_REDIS", "redis://127.0.0.1:16379/0")


def _reachable(hostport: str) -> bool:
    host, port = hostport.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def kafka_up() -> str:
    if not _reachable(KAFKA):
        pytest.fail(
            f"Kafka is not reachable at {KAFKA}: start it with deploy/kafka/kafka.sh start "
            "(or run the tests with `bash .ci/run`)"
        )
    return KAFKA


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def kafka_settings(kafka_up: str, namespace: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=kafka_up, namespace=namespace, partitions=2)


@pytest.fixture
def worker_settings(tmp_path: Path) -> WorkerSettings:
    return WorkerSettings(
        web_port=free_port(),
        data_dir=str(tmp_path / "not-yet" / "worker"),  # created with its parents by kvgate
        session_timeout_s=6.0,
        rebalance_timeout_s=6.0,
        heartbeat_interval_s=0.5,
        commit_interval_s=0.5,
    )


@pytest.fixture
def supervisor(
    tmp_path: Path, kafka_settings: KafkaSettings, worker_settings: WorkerSettings
) -> Iterator[Supervisor]:
    env = {
        "KVGATE_KAFKA__BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
        "KVGATE_KAFKA__NAMESPACE": kafka_settings.namespace,
        "KVGATE_KAFKA__PARTITIONS": str(kafka_settings.partitions),
        "KVGATE_WORKER__WEB_PORT": str(worker_settings.web_port),
        "KVGATE_WORKER__DATA_DIR": worker_settings.data_dir,
        "KVGATE_WORKER__SESSION_TIMEOUT_S": str(worker_settings.session_timeout_s),
        "KVGATE_WORKER__REBALANCE_TIMEOUT_S": str(worker_settings.rebalance_timeout_s),
        "KVGATE_WORKER__HEARTBEAT_INTERVAL_S": str(worker_settings.heartbeat_interval_s),
        "KVGATE_WORKER__COMMIT_INTERVAL_S": str(worker_settings.commit_interval_s),
        "KVGATE_CLICKHOUSE__PATH": str(tmp_path / "clickhouse"),
    }
    sup = Supervisor(tmp_path / "logs", env)
    yield sup
    logs = {name: p.tail(30) for name, p in sup.procs.items()}
    sup.stop_all()
    for name, text in logs.items():  # visible with -rA or on failure
        print(f"--- {name} ---\n{text}")


async def wait_until(
    check: Callable[[], Awaitable[Any]], timeout_s: float, what: str, interval_s: float = 0.05
) -> Any:
    """Poll ``check`` until it returns a truthy value; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            result = await check()
        except Exception as exc:
            last = exc
        else:
            last = result
            if result:
                return result
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {last!r}")
