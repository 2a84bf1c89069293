"""Infrastructure failures as one or two lines: what failed, where, and what to do.

A command that cannot reach Kafka, Redis or ClickHouse, or cannot bind its port, ends with
:func:`explain`'s sentence instead of a traceback (``--log-level DEBUG`` keeps the traceback).
The cause is searched through the exception's chain and groups: the useful error is often
wrapped (an ``ExceptionGroup`` from a task group, a ``StreamError`` raised from aiokafka's).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

__all__ = ["explain"]

_KAFKA = (
    "start it (bash deploy/kafka/kafka.sh start; kvgate demo starts its own) or point "
    "KVGATE_KAFKA__BOOTSTRAP_SERVERS at a running broker"
)
_REDIS = (
    "start it (bash deploy/local/redis.sh start) or point KVGATE_REDIS__URL at a running "
    "server, or use admission.backend=inproc for one router"
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the members of its groups (each once)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _kind(e: BaseException) -> str | None:
    module = type(e).__module__
    name = type(e).__name__
    if module.startswith("aiokafka") or name == "StreamError":
        return "kafka"
    if module.startswith("redis") or name in ("AdmissionError", "StoreReset"):
        return "redis"
    if module.startswith("clickhouse_connect") or module.startswith("chdb"):
        return "clickhouse"
    return None


def explain(exc: BaseException) -> str | None:
    """One or two lines for an infrastructure failure; None for anything else (a bug keeps
    its traceback)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            return (
                f"cannot listen: {_first_line(e)}.\n"
                "Another process holds that port: stop it, or choose another port "
                "(--port, or the setting's KVGATE_…__PORT)."
            )
        kind = _kind(e)
        if kind == "kafka":
            return f"Kafka is unreachable or refused: {_first_line(e)}.\nTo fix: {_KAFKA}."
        if kind == "redis":
            return f"Redis is unreachable or refused: {_first_line(e)}.\nTo fix: {_REDIS}."
        if kind == "clickhouse":
            return (
                f"ClickHouse failed: {_first_line(e)}.\n"
                "To fix: check KVGATE_CLICKHOUSE__* (or the local chDB directory) and that the "
                "database exists (kvgate sink creates it)."
            )
    return None
