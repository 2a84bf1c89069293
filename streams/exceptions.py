"""Errors raised by kvgate's streaming layer; third-party errors are wrapped at the adapter."""

from __future__ import annotations

__all__ = ["KvgateError", "SchemaError", "StreamError"]


class KvgateError(Exception):
    """Root of every error kvgate raises on purpose."""


class SchemaError(KvgateError):
    """A message did not match the value model of its topic."""


class StreamError(KvgateError):
    """Kafka could not be reached or refused an operation."""
