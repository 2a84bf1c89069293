"""The router's layering, checked on every module's imports (lazy ones included):

1. ``router.decision`` is pure and synchronous: the standard library, pydantic, the settings and
   the pure parts of ``admission`` and ``streams`` — never asyncio, a transport, a broker or a
   store client, and nothing of the router's flow or HTTP layers.
2. ``router.flow`` is async and transport-free: never aiohttp or gRPC, nor the router's HTTP
   surfaces, its endpoint picker or its service.
3. ``analytics`` takes from the router only the decision core and its settings: the simulator
   and the tools run the live router's decisions, not a copy of its service.
4. ``router`` never imports ``deploy`` (the launchers and the CLI sit above it).
5. The surfaces (``router.http``, ``router.epp``) never compose a decision: they go through the
   flow layer's director, not ``router.decision.pipeline``.
6. ``router.wire`` is transport only: HTTP/1.1 on asyncio protocols, no framework (no aiohttp)
   and nothing of kvgate but the OpenAI error shape (``streams.openai``).

``ALLOWED`` lists the imports that break a contract today, each to be removed by the move that
fixes it; an entry that no longer occurs fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# third-party packages the decision core may never import
IMPURE = ("asyncio", "aiohttp", "grpc", "aiokafka", "redis", "faust", "mode", "uvloop")
# kvgate modules the decision core may import (prefixes)
DECISION_MAY = (
    "router.decision",
    "router.settings",
    "admission.core",
    "admission.slo",
    "admission.preempt",
    "admission.settings",
    "admission.pools",
    "admission.exceptions",
    "streams.blocks",
    "streams.schemas",
    "streams.labels",
    "streams.fit",
    "streams.tokenization",
)
OWN = ("router", "admission", "streams", "agents", "analytics", "deploy")
TRANSPORTS = (
    "aiohttp",
    "grpc",
    "router.http",
    "router.epp",
    "router.eppexchange",
    "router.runtime",
    "router.loops",
)
ANALYTICS_MAY = ("router.decision", "router.settings")

# (importing module, imported module): today's exceptions, removed as the moves land
ALLOWED: set[tuple[str, str]] = set()


def _modules(package: str) -> dict[str, pathlib.Path]:
    base = ROOT / package.replace(".", "/")
    out = {}
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """Every module ``module`` imports, at any depth of its code (``from x import y``: ``x``
    and ``x.y``, ``y`` being a module or a name in it)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations() -> set[tuple[str, str]]:
    bad: set[tuple[str, str]] = set()
    for module, path in _modules("router.decision").items():
        for name in _imports(module, path):
            if _within(name, IMPURE):
                bad.add((module, name))
            elif _within(name, OWN) and not _within(name, DECISION_MAY):
                # ``from router.decision import x``: the package itself is fine
                bad.add((module, name))
    for module, path in _modules("router.flow").items():
        bad.update((module, name) for name in _imports(module, path) if _within(name, TRANSPORTS))
    for module, path in _modules("analytics").items():
        bad.update(
            (module, name)
            for name in _imports(module, path)
            if _within(name, ("router",)) and not _within(name, ANALYTICS_MAY)
        )
    for module, path in _modules("router").items():
        bad.update((module, name) for name in _imports(module, path) if _within(name, ("deploy",)))
    surfaces = {
        **_modules("router.http"),
        "router.epp": ROOT / "router" / "epp.py",
        "router.eppexchange": ROOT / "router" / "eppexchange.py",
    }
    for module, path in surfaces.items():
        bad.update(
            (module, name)
            for name in _imports(module, path)
            if _within(name, ("router.decision.pipeline",))
        )
    for module, path in _modules("router.wire").items():
        bad.update(
            (module, name)
            for name in _imports(module, path)
            if _within(name, ("aiohttp",))
            or (_within(name, OWN) and not _within(name, ("router.wire", "streams.openai")))
        )
    return bad


def test_the_layers_hold_but_for_the_listed_exceptions() -> None:
    bad = _violations()
    assert bad - ALLOWED == set(), "imports that break the router's layering"
    assert ALLOWED - bad == set(), "listed exceptions that no longer occur: remove them"


def test_the_import_walk_sees_lazy_and_relative_imports(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import json\nfrom . import sibling\n\ndef f():\n    import aiohttp\n"
        "    from router.http.edge import Refusal\n"
    )
    found = _imports("router.decision.m", src)
    assert {"json", "router.decision.sibling", "aiohttp", "router.http.edge"} <= found
