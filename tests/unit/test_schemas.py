from pathlib import Path

import pytest

from streams.codec import decode, encode
from streams.exceptions import SchemaError
from streams.jsonschema import render_schemas
from streams.schemas import Heartbeat, KvEventBatch
from streams.topics import ALL_TOPICS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "topics"


def test_every_topic_declared_once_with_a_versioned_model() -> None:
    names = [t.suffix for t in ALL_TOPICS]
    assert len(names) == len(set(names)) == 7
    for spec in ALL_TOPICS:
        assert "schema_version" in spec.value_model.model_fields


def test_published_json_schemas_are_current() -> None:
    """Regenerate with `kvgate schemas` when this fails."""
    for name, text in render_schemas().items():
        path = DOCS / name
        assert path.exists(), f"{path} missing: run `kvgate schemas`"
        assert path.read_text() == text, f"{path} is stale: run `kvgate schemas`"


def test_roundtrip() -> None:
    b = KvEventBatch(node_id="n", epoch="e", seq=3, ts=1.0, block_size=16, stored=[2**63 - 1])
    assert decode(KvEventBatch, encode(b)) == b


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"{}",
        b'{"schema_version": 2, "node_id": "n"}',
        b'{"schema_version":1,"node_id":"n","epoch":"e","seq":-1,"ts":1,"endpoint":"x","model":"m",'
        b'"block_size":16,"kv_blocks_total":1,"kv_blocks_used":0,"running":0,"waiting":0}',
        # (an unknown field is not invalid: a newer producer's, ignored; test_schemas_compat.py)
        None,
    ],
)
def test_invalid_messages_raise_schema_error(raw: bytes | None) -> None:
    with pytest.raises(SchemaError):
        decode(Heartbeat, raw)
