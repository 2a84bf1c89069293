"""The tenant salt: one per cache group and client salt, never another group's."""

from __future__ import annotations

from admission.settings import Tenant
from router.flow.salt import cache_group, isolated, tenant_salt
from router.parse import parse_request


def test_a_salt_names_its_group_and_client_salt_alone() -> None:
    assert tenant_salt("a") == tenant_salt("a")
    salts = {
        tenant_salt("a"),
        tenant_salt("b"),
        tenant_salt("a", ""),
        tenant_salt("a", "x"),
        tenant_salt("a\x01x"),  # a group named like another's group and salt
        tenant_salt("ab"),
        tenant_salt("a", "b"),
    }
    assert len(salts) == 7
    assert all(s.startswith("kvgate-") and len(s) == 7 + 32 for s in salts)


def test_a_tenant_shares_only_with_its_cache_group() -> None:
    assert cache_group(Tenant(name="a")) == "a"
    assert cache_group(Tenant(name="c", cache_group="partners")) == "partners"


def test_isolated_replaces_the_bodys_salt_and_the_hashes_root() -> None:
    p = parse_request(b'{"model": "m", "prompt": "hi", "cache_salt": "b-salt"}', False, 16)
    q = isolated(p, Tenant(name="a"))
    assert q.cache_salt == q.body["cache_salt"] == tenant_salt("a", "b-salt")
    assert p.body["cache_salt"] == "b-salt"  # the parsed request itself is left as it was
