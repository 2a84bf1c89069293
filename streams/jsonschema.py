"""JSON Schema of every topic's value model, published under ``docs/topics/``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from streams.topics import ALL_TOPICS

__all__ = ["render_schemas", "write_schemas"]


def render_schemas() -> dict[str, str]:
    """File name → schema text, for every topic."""
    out: dict[str, str] = {}
    for spec in ALL_TOPICS:
        schema: dict[str, Any] = spec.value_model.model_json_schema()
        schema["$id"] = f"kvgate/{spec.suffix}.schema.json"
        schema["x-kvgate-topic"] = {
            "name": f"<namespace>.{spec.suffix}",
            "key": spec.key,
            "cleanup_policy": spec.cleanup_policy,
            "retention_ms": spec.retention_ms,
        }
        out[f"{spec.suffix}.schema.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def write_schemas(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_schemas().items():
        path = folder / name
        path.write_text(text)
        written.append(path)
    return written
