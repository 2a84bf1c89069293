"""The public traces the README, replay and the routing benchmark use ship with kvgate, byte for
byte as their sources published them (traces/README.md lists the checksums)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

TRACES = Path(__file__).resolve().parents[2] / "traces"


def test_every_trace_matches_its_published_checksum() -> None:
    listed = re.findall(r"^([0-9a-f]{64})  (\S+)$", (TRACES / "README.md").read_text(), re.M)
    assert len(listed) == 3
    for digest, name in listed:
        assert hashlib.sha256((TRACES / name).read_bytes()).hexdigest() == digest, name
    shipped = {p.name for p in TRACES.iterdir() if p.name != "README.md"}
    assert shipped == {name for _, name in listed}
