"""Tenant cache isolation: the ``cache_salt`` kvgate gives every request of a tenant.

vLLM (V1) and SGLang hash a request's ``cache_salt`` into its first KV block, so requests with
different salts never share a cached prefix: a tenant replaying another tenant's prompt cannot
learn from its latency or its ``cached_tokens`` that the prompt was seen. kvgate derives the salt
from the tenant's *cache group* (its ``cache_group``, else its name) and the salt the client
sent, if any, and replaces whatever the body carried: no client can choose a salt another tenant's
requests get. Tenants that trust each other share a ``cache_group`` and so their cached prefixes.

The router's own hashes chain from the same salt (:func:`streams.blocks.chain_root`), as do the
agents' from the engine's KV events, so the index, the router's prefill memory, pre-warming and
the hit accounting all keep tenants apart exactly as the engines do.

Isolation applies where there is something to isolate: a router with API-key tenants configured
(``admission.tenants``); then anonymous clients form one more group. ``router.cache_isolation
= "off"`` passes clients' salts through unchanged (one shared cache).
"""

from __future__ import annotations

from dataclasses import replace
from hashlib import blake2b

from admission.settings import Tenant
from router.parse import ParsedRequest

__all__ = ["cache_group", "isolated", "tenant_salt"]


def cache_group(tenant: Tenant) -> str:
    """Whose cached prefixes ``tenant``'s requests may hit: its group's."""
    return tenant.cache_group or tenant.name


def tenant_salt(group: str, client_salt: str | None = None) -> str:
    """The salt of ``group``'s requests that carry ``client_salt`` (None: none). Injective in
    both (length-prefixed): no group and salt give another group's salt."""
    h = blake2b(digest_size=16, person=b"kvgate-salt")
    g = group.encode()
    h.update(len(g).to_bytes(4, "big") + g)
    if client_salt is not None:
        h.update(b"\x01" + client_salt.encode())
    return "kvgate-" + h.hexdigest()


def isolated(p: ParsedRequest, tenant: Tenant) -> ParsedRequest:
    """``p`` as the engine is asked it: salted for ``tenant``'s cache group (the body's
    ``cache_salt`` replaced, the router's hashes chained from it)."""
    salt = tenant_salt(cache_group(tenant), p.cache_salt)
    return replace(p, cache_salt=salt, body={**p.body, "cache_salt": salt})
