"""A request body nested deeper than kvgate bounds (64 levels) is a 400 with its reason before
admission — not a 500 after admission and routing, as bodies of 256–1,023 levels were (orjson
parses up to 1,024)."""

from __future__ import annotations

from tests.edgekit import MODEL, bearer, edge


async def test_deeply_nested_json_is_refused_with_a_reason_before_admission() -> None:
    async with edge() as e:
        for depth in (65, 300, 1000):
            raw = (
                b'{"model": "'
                + MODEL.encode()
                + b'", "prompt": "hi", "max_tokens": 2, "x": '
                + b"[" * depth
                + b"]" * depth
                + b"}"
            )
            status, body, _ = await e.call(
                "POST", "/v1/completions", headers=bearer("sk-alpha"), data=raw
            )
            assert status == 400, (depth, status, body)
            assert "nests deeper" in body["error"]["message"]
            assert await e.reservations() == 0
        ok = b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": 2, "x": '
        ok += b"[" * 40 + b"]" * 40 + b"}"
        status, _, _ = await e.call("POST", "/v1/completions", headers=bearer("sk-alpha"), data=ok)
        assert status == 200
