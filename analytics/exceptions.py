"""Analytics errors; ClickHouse client errors are wrapped here."""

from __future__ import annotations

from streams.exceptions import KvgateError

__all__ = ["ClickHouseError"]


class ClickHouseError(KvgateError):
    """A ClickHouse statement failed (either backend)."""
