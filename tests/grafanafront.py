"""A protocol-level test double of Grafana's HTTP API (Grafana itself cannot be installed on
these machines): the endpoints ``kvgate grafana push`` uses, with Grafana's status codes and
response shapes, authentication, and the checks Grafana makes on what it is given. Test-only."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class GrafanaFront:
    def __init__(self, user: str = "admin", password: str = "admin", token: str = "") -> None:
        self.basic = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.token = token
        self.datasources: dict[str, dict[str, Any]] = {}
        self.folders: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def _body(self) -> Any:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else None

            def do_GET(self) -> None:
                front.handle(self, "GET", None)

            def do_POST(self) -> None:
                front.handle(self, "POST", self._body())

            def do_PUT(self) -> None:
                front.handle(self, "PUT", self._body())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> GrafanaFront:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _authorized(self, req: BaseHTTPRequestHandler) -> bool:
        auth = req.headers.get("Authorization", "")
        return auth == self.basic or bool(self.token and auth == f"Bearer {self.token}")

    def handle(self, req: BaseHTTPRequestHandler, method: str, body: Any) -> None:
        path = req.path.split("?")[0].rstrip("/")
        with self._lock:
            self.calls.append((method, path))
            if path == "/api/health":
                return _reply(req, 200, {"database": "ok", "version": "11.3.0"})
            if not self._authorized(req):
                return _reply(req, 401, {"message": "Unauthorized"})
            status, out = self._route(method, path, body)
        _reply(req, status, out)

    def _route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        parts = path.split("/")[2:]  # after /api
        if parts == ["frontend", "settings"]:
            return 200, {"buildInfo": {"version": "11.3.0", "edition": "Open Source"}}
        if parts[:1] == ["datasources"]:
            return self._datasources(method, parts[1:], body)
        if parts[:1] == ["folders"]:
            return self._folders(method, parts[1:], body)
        if parts == ["dashboards", "db"] and method == "POST":
            return self._save_dashboard(body)
        if parts[:2] == ["dashboards", "uid"] and method == "GET":
            d = self.dashboards.get(parts[2])
            if d is None:
                return 404, {"message": "Dashboard not found"}
            return 200, d
        return 404, {"message": "Not found"}

    def _datasources(self, method: str, rest: list[str], body: Any) -> tuple[int, Any]:
        if method == "POST" and not rest:
            for key in ("name", "type", "access"):
                if not body.get(key):
                    return 400, {"message": f"{key} is required"}
            if body.get("uid") in self.datasources:
                return 409, {"message": "data source with the same uid already exists"}
            ds = {**body, "id": len(self.datasources) + 1}
            self.datasources[body["uid"]] = ds
            return 200, {"datasource": ds, "id": ds["id"], "message": "Datasource added"}
        if rest[:1] == ["uid"] and len(rest) == 2:
            ds = self.datasources.get(rest[1])
            if ds is None:
                return 404, {"message": "Data source not found"}
            if method == "GET":
                return 200, ds
            if method == "PUT":
                self.datasources[rest[1]] = {**body, "id": ds["id"]}
                return 200, {"message": "Datasource updated", "id": ds["id"]}
        return 404, {"message": "Not found"}

    def _folders(self, method: str, rest: list[str], body: Any) -> tuple[int, Any]:
        if method == "POST" and not rest:
            if not body.get("title"):
                return 400, {"message": "folder title cannot be empty"}
            uid = body.get("uid") or f"f{len(self.folders)}"
            if uid in self.folders:
                return 409, {"message": "a folder with the same uid already exists"}
            self.folders[uid] = {"uid": uid, "title": body["title"], "id": len(self.folders) + 1}
            return 200, self.folders[uid]
        if method == "GET" and len(rest) == 1:
            f = self.folders.get(rest[0])
            return (200, f) if f is not None else (404, {"message": "folder not found"})
        return 404, {"message": "Not found"}

    def _save_dashboard(self, body: Any) -> tuple[int, Any]:
        d = body.get("dashboard") if isinstance(body, dict) else None
        if not isinstance(d, dict) or not d.get("title"):
            return 400, {"message": "Dashboard title cannot be empty"}
        folder = body.get("folderUid")
        if folder and folder not in self.folders:
            return 400, {"message": "folder not found"}
        uid = d.get("uid")
        old = self.dashboards.get(uid) if uid else None
        if old is not None and not body.get("overwrite"):
            return 412, {"status": "version-mismatch", "message": "dashboard has been changed"}
        version = (old["meta"]["version"] + 1) if old else 1
        self.dashboards[uid] = {"dashboard": d, "meta": {"folderUid": folder, "version": version}}
        return 200, {
            "id": len(self.dashboards),
            "uid": uid,
            "url": f"/d/{uid}/{d['title'].lower().replace(' ', '-')}",
            "status": "success",
            "version": version,
        }


def _reply(req: BaseHTTPRequestHandler, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    req.send_response(status)
    req.send_header("Content-Type", "application/json")
    req.send_header("Content-Length", str(len(data)))
    req.end_headers()
    req.wfile.write(data)
