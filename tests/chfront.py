"""A protocol-level test double of a ClickHouse server: ClickHouse's HTTP interface in front of
chDB (the same engine), so that the clickhouse-connect backend is exercised for real on machines
where no ClickHouse server can be installed. Test-only; never part of the product.

Handles what clickhouse-connect sends with ``compress=False``: ``/ping``; a query in the body or in
the ``query`` parameter, answered in the format its ``FORMAT`` clause or ``default_format`` names;
``INSERT … FORMAT JSONEachRow`` with the rows in the body; ``INSERT … FORMAT Native`` bodies, which
chDB reads back from a temporary file. Errors come back as HTTP 500 with ClickHouse's error text and
``X-ClickHouse-Exception-Code``.
"""

from __future__ import annotations

import re
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

_FORMAT = re.compile(r"\bFORMAT\s+(\w+)\s*;?\s*$", re.IGNORECASE)
_INSERT = re.compile(r"^\s*INSERT\s+INTO\s+(.+?)\s+FORMAT\s+(\w+)\s*$", re.IGNORECASE | re.DOTALL)
_CODE = re.compile(r"Code:\s*(\d+)")


class ChdbFront:
    def __init__(self, path: str, host: str = "127.0.0.1", port: int = 0) -> None:
        from chdb import session

        self._session: Any = session.Session(path)
        self._lock = threading.Lock()
        self._tmp = Path(tempfile.mkdtemp(prefix="chfront-"))
        self.inserted_rows: dict[str, int] = {}  # table -> rows received by INSERTs
        self.active = 0  # requests being handled
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def do_GET(self) -> None:
                front.handle(self, b"")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                front.handle(self, self.rfile.read(length) if length else b"")

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ChdbFront:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self._lock:
            self._session.close()

    def _run(self, sql: str, fmt: str) -> bytes:
        with self._lock:
            res = self._session.query(sql, fmt)
        return bytes(res.bytes())

    def handle(self, req: BaseHTTPRequestHandler, body: bytes) -> None:
        with self._lock:
            self.active += 1
        try:
            self._handle(req, body)
        finally:
            with self._lock:
                self.active -= 1

    def _handle(self, req: BaseHTTPRequestHandler, body: bytes) -> None:
        url = urlparse(req.path)
        if url.path.rstrip("/") == "/ping":
            self._reply(req, 200, b"Ok.\n", "text/plain")
            return
        params = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if "database" in params:
                self._run(f"USE {params['database']}", "CSV")
            if "query" in params:
                sql, data = params["query"], body
            else:
                sql, data = body.decode(), b""
            if not data and sql.lstrip()[:6].upper() == "INSERT" and "\n" in sql:
                sql, _, rest = sql.partition("\n")  # the query's first line, then the rows
                data = rest.encode()
            insert = _INSERT.match(sql)
            if insert and data:
                table, fmt = insert.group(1), insert.group(2)
                if fmt.lower() == "native":
                    f = self._tmp / f"{uuid.uuid4().hex}.native"
                    f.write_bytes(data)
                    n = int(self._run(f"SELECT count() FROM file('{f}', 'Native')", "CSV"))
                    self._run(f"INSERT INTO {table} SELECT * FROM file('{f}', 'Native')", "CSV")
                    f.unlink()
                else:
                    n = len([line for line in data.splitlines() if line.strip()])
                    self._run(sql + "\n" + data.decode(), "CSV")
                with self._lock:
                    self.inserted_rows[table] = self.inserted_rows.get(table, 0) + n
                self._reply(req, 200, b"", "text/plain")
                return
            m = _FORMAT.search(sql)
            fmt = m.group(1) if m else params.get("default_format", "TabSeparated")
            out = self._run(sql, fmt)
            self._reply(req, 200, out, "application/octet-stream", fmt)
        except Exception as exc:  # every engine error becomes a ClickHouse error reply
            text = str(exc)
            code = _CODE.search(text)
            self._reply(
                req, 500, text.encode(), "text/plain", exception_code=code.group(1) if code else "1"
            )

    @staticmethod
    def _reply(
        req: BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        ctype: str,
        fmt: str | None = None,
        exception_code: str | None = None,
    ) -> None:
        req.send_response(status)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        req.send_header("X-ClickHouse-Server-Display-Name", "chdb-front")
        req.send_header("X-ClickHouse-Timezone", "UTC")
        req.send_header("X-ClickHouse-Query-Id", uuid.uuid4().hex)
        req.send_header(
            "X-ClickHouse-Summary",
            '{"read_rows":"0","read_bytes":"0","written_rows":"0",'
            '"written_bytes":"0","total_rows_to_read":"0"}',
        )
        if fmt:
            req.send_header("X-ClickHouse-Format", fmt)
        if exception_code:
            req.send_header("X-ClickHouse-Exception-Code", exception_code)
        req.end_headers()
        req.wfile.write(body)


def sink_env(front: ChdbFront, namespace: str, **extra: str) -> dict[str, str]:
    """Environment for kvgate processes that talk to ``front`` as their ClickHouse server, with
    a sink group of the test's own."""
    return {
        "KVGATE_CLICKHOUSE__BACKEND": "server",
        "KVGATE_CLICKHOUSE__PORT": str(front.port),
        "KVGATE_CLICKHOUSE__COMPRESS": "false",
        "KVGATE_SINK__GROUP_ID": f"{namespace}-sink",
        **extra,
    }
