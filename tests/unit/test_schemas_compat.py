"""Rolling upgrades: a consumer reads a newer producer's message (one with a field added since,
within the same schema_version) as the version it knows; what it does know is still validated,
and an unknown schema_version is still refused."""

from __future__ import annotations

import json

import pytest

from streams.codec import decode
from streams.exceptions import SchemaError
from streams.schemas import Heartbeat, KvEventBatch
from tests.factories import heartbeat


def test_a_field_added_by_a_newer_agent_is_ignored_not_dead_lettered() -> None:
    body = json.loads(heartbeat("n1", seq=3).model_dump_json())
    body["kv_blocks_swapped"] = 12  # a field this version does not know
    hb = decode(Heartbeat, json.dumps(body).encode())
    assert hb.node_id == "n1" and hb.seq == 3
    assert "kv_blocks_swapped" not in hb.model_dump()


def test_known_fields_are_still_validated_and_unknown_versions_refused() -> None:
    body = json.loads(heartbeat("n1", seq=3).model_dump_json())
    with pytest.raises(SchemaError, match="seq"):
        decode(Heartbeat, json.dumps({**body, "seq": -1, "extra": 1}).encode())
    with pytest.raises(SchemaError, match="schema_version"):
        decode(Heartbeat, json.dumps({**body, "schema_version": 2}).encode())
    batch = {"node_id": "n", "epoch": "e", "seq": 1, "ts": 1.0, "block_size": 16, "new": [1]}
    assert decode(KvEventBatch, json.dumps(batch).encode()).stored == []
