"""Node labels (zone, GPU type, …): Kubernetes-like ``key=value`` pairs, checked where they enter
(agent settings, heartbeats, tenant settings, request headers)."""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["KEY", "MAX_NODE_LABELS", "VALUE", "check_labels"]

KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")
VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$")
MAX_NODE_LABELS = 32


def check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """``labels`` if there are few enough and every key and value is well formed."""
    if len(labels) > MAX_NODE_LABELS:
        raise ValueError(f"at most {MAX_NODE_LABELS} labels")
    for k, v in labels.items():
        if not KEY.match(k) or not VALUE.match(v):
            raise ValueError(f"bad label {k[:80]!r}={v[:80]!r}: keys and values are [A-Za-z0-9._-]")
    return dict(labels)
