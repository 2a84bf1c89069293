"""Admission errors (Redis errors are wrapped here)."""

from __future__ import annotations

from streams.exceptions import KvgateError

__all__ = ["AdmissionError"]


class AdmissionError(KvgateError):
    """The reservation store could not answer."""
