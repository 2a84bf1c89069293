"""Admission budgets per (pool, model).

A request draws on the budget of the nodes that can serve it: the KV blocks and slots of the
healthy nodes of its pool that run its base model. Requests for a LoRA adapter share their base
model's budget, as they share the engine's KV cache. Another model's reservations never refuse
it: an idle model is admitted while a saturated one is refused by its own watermarks.
"""

from __future__ import annotations

__all__ = ["budget_key"]


def budget_key(pool: str, model: str) -> str:
    """The name of a (pool, base model) budget in the reservation store, the ledger and the
    metrics (``|`` is the store's field separator, so it never appears in a key)."""
    return f"{pool}:{model}".replace("|", "_")
