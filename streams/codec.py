"""Bytes ↔ topic values. Validation errors become :class:`SchemaError`."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError

from streams.exceptions import SchemaError

__all__ = ["decode", "encode", "encode_key"]

M = TypeVar("M", bound=BaseModel)


def encode(value: BaseModel) -> bytes:
    """``value.model_dump_json()`` as bytes, without the detour through ``str``."""
    return type(value).__pydantic_serializer__.to_json(value)


def encode_key(key: str | None) -> bytes | None:
    return None if key is None else key.encode()


def decode(model: type[M], raw: bytes | None) -> M:
    if raw is None:
        raise SchemaError("empty value (tombstone) on a topic that does not allow one")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
            for e in exc.errors()[:5]
        )
        raise SchemaError(f"{model.__name__}: {errors}") from exc
