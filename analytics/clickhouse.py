"""One interface over ClickHouse: embedded chDB (local default) or a server (clickhouse-connect).

chDB lets one process open a data path at a time, so the process that owns the sink also answers
the queries (the demo summary, reports); a second process must use the server backend.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Protocol

import orjson

from analytics.exceptions import ClickHouseError
from analytics.settings import ClickHouseSettings

__all__ = ["ChdbBackend", "ClickHouse", "ServerBackend", "open_clickhouse"]


class ClickHouse(Protocol):
    def command(self, sql: str) -> None: ...
    def insert_json(self, table: str, rows: Iterable[dict[str, Any]]) -> int: ...
    def query(self, sql: str) -> list[dict[str, Any]]: ...
    def close(self) -> None: ...


def _json_lines(rows: Iterable[dict[str, Any]]) -> tuple[bytes, int]:
    parts = [orjson.dumps(r) for r in rows]
    return b"\n".join(parts), len(parts)


class ChdbBackend:
    def __init__(self, path: str) -> None:
        from chdb import session

        self._lock = threading.Lock()
        try:
            self._session: Any = session.Session(path)  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise ClickHouseError(f"cannot open chDB at {path}: {exc}") from exc

    def _run(self, sql: str, fmt: str = "CSV") -> bytes:
        with self._lock:
            try:
                res = self._session.query(sql, fmt)
            except Exception as exc:
                raise ClickHouseError(f"{exc}\n  in: {sql[:300]}") from exc
        out: bytes = res.bytes() if hasattr(res, "bytes") else bytes(res)
        return out

    def command(self, sql: str) -> None:
        self._run(sql)

    def insert_json(self, table: str, rows: Iterable[dict[str, Any]]) -> int:
        data, n = _json_lines(rows)
        if n:
            self._run(f"INSERT INTO {table} FORMAT JSONEachRow\n" + data.decode())
        return n

    def query(self, sql: str) -> list[dict[str, Any]]:
        raw = self._run(sql, "JSONEachRow")
        return [orjson.loads(line) for line in raw.splitlines() if line.strip()]

    def close(self) -> None:
        with self._lock:
            self._session.close()


class ServerBackend:
    def __init__(self, s: ClickHouseSettings) -> None:
        import clickhouse_connect

        try:
            self._client = clickhouse_connect.get_client(
                host=s.host,
                port=s.port,
                username=s.username,
                password=s.password.get_secret_value(),
                secure=s.secure,
                compress=s.compress,
            )
        except Exception as exc:
            raise ClickHouseError(f"cannot reach ClickHouse at {s.host}:{s.port}: {exc}") from exc

    def command(self, sql: str) -> None:
        try:
            self._client.command(sql)
        except Exception as exc:
            raise ClickHouseError(f"{exc}\n  in: {sql[:300]}") from exc

    def insert_json(self, table: str, rows: Iterable[dict[str, Any]]) -> int:
        data, n = _json_lines(rows)
        if n:
            try:
                self._client.raw_insert(table, insert_block=data, fmt="JSONEachRow")
            except Exception as exc:
                raise ClickHouseError(f"insert into {table} failed: {exc}") from exc
        return n

    def query(self, sql: str) -> list[dict[str, Any]]:
        try:
            raw = self._client.raw_query(sql, fmt="JSONEachRow")
        except Exception as exc:
            raise ClickHouseError(f"{exc}\n  in: {sql[:300]}") from exc
        return [orjson.loads(line) for line in bytes(raw).splitlines() if line.strip()]

    def close(self) -> None:
        self._client.close()


def open_clickhouse(s: ClickHouseSettings) -> ClickHouse:
    if s.backend == "chdb":
        return ChdbBackend(s.path)
    return ServerBackend(s)
