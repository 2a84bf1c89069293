"""Admission errors (Redis errors are wrapped here)."""

from __future__ import annotations

from streams.exceptions import KvgateError

__all__ = ["AdmissionError", "StoreReset"]


class AdmissionError(KvgateError):
    """The reservation store could not answer."""


class StoreReset(AdmissionError):
    """The reservation store lost its data and is not rebuilt yet: nothing can be admitted."""
