"""Offloaded copies are a cheaper miss: the index keeps them apart from GPU blocks, and a
prompt's match says how far each node's GPU prefix goes and how far its offloaded copies carry
on from there (what vLLM reuses from GPU, then loads from its CPU tier)."""

from __future__ import annotations

from streams.blocks import offloaded
from streams.prefix_index import PrefixIndex

H = [101, 102, 103, 104, 105]
COPIES = [offloaded(h) for h in H]


def test_gpu_prefix_then_offloaded_run() -> None:
    ix = PrefixIndex()
    ix.add_many("gpu-then-cpu", [101, 102, offloaded(103), offloaded(104)])
    ix.add_many("cpu-only", COPIES)
    ix.add_many("gap", [offloaded(102), offloaded(103)])  # nothing at the first position
    ix.add_many("gpu-only", H[:3])
    ix.add_many("both", [*H[:2], *COPIES])  # a GPU block's offloaded copy too
    gpu, tier = ix.match_tiers(H, COPIES)
    assert gpu == {"gpu-then-cpu": 2, "gpu-only": 3, "both": 2}
    assert tier == {"gpu-then-cpu": 2, "cpu-only": 5, "both": 3}
    assert ix.match(H) == gpu  # offloaded copies never count as GPU hits


def test_no_offloaded_copies_changes_nothing() -> None:
    ix = PrefixIndex()
    ix.add_many("a", H[:4])
    assert ix.match_tiers(H, COPIES) == ({"a": 4}, {})
