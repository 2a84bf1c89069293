"""Where kvgate keeps its local state (the worker's tables, the embedded ClickHouse, the demo's
logs, the local Kafka and Redis): one directory, whatever the current directory is.

``KVGATE_HOME`` when set; else, run from a source checkout (the package's parent holds kvgate's
``pyproject.toml``), its ``.local`` (``KVGATE_LOCAL``, the scripts' older name, is honoured
too); else ``$XDG_STATE_HOME/kvgate`` (``~/.local/state/kvgate``). A setting given as a path
(``KVGATE_CLICKHOUSE__PATH``, ``KVGATE_WORKER__DATA_DIR``) still wins.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["home"]

_CHECKOUT = Path(__file__).resolve().parent.parent


@functools.cache
def _in_checkout() -> bool:
    """kvgate runs from a source checkout (read once: it does not change while it runs)."""
    project = _CHECKOUT / "pyproject.toml"
    try:
        return project.is_file() and 'name = "kvgate"' in project.read_text()
    except OSError:
        return False


def home() -> Path:
    """kvgate's state directory (not created here)."""
    for name in ("KVGATE_HOME", "KVGATE_LOCAL"):
        value = os.environ.get(name)
        if value:
            return Path(value).expanduser().resolve()
    if _in_checkout():
        return _CHECKOUT / ".local"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "kvgate"
