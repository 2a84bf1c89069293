"""Offloaded copies are a cheaper miss: the index keeps them apart from GPU blocks, and a
prompt's match says how far each node's GPU prefix goes and how far its offloaded copies carry
on from there (what vLLM reuses from GPU, then loads from its CPU tier)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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
    gpu, tier = ix.match_tiers(H, offloaded)
    assert gpu == {"gpu-then-cpu": 2, "gpu-only": 3, "both": 2}
    assert tier == {"gpu-then-cpu": 2, "cpu-only": 5, "both": 3}
    assert ix.match(H) == gpu  # offloaded copies never count as GPU hits


def test_no_offloaded_copies_changes_nothing() -> None:
    ix = PrefixIndex()
    ix.add_many("a", H[:4])
    assert ix.match_tiers(H, offloaded) == ({"a": 4}, {})


@settings(max_examples=300, deadline=None)
@given(
    holdings=st.lists(
        st.tuples(
            st.lists(st.booleans(), min_size=5, max_size=5),
            st.lists(st.booleans(), min_size=5, max_size=5),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_tiers_match_a_walk_of_every_node(holdings: list[tuple[list[bool], list[bool]]]) -> None:
    """The run-by-run walk equals walking every node's blocks one by one."""
    ix = PrefixIndex()
    want_gpu: dict[str, int] = {}
    want_tier: dict[str, int] = {}
    for n, (on_gpu, copied) in enumerate(holdings):
        node = f"n{n}"
        ix.add_many(node, [h for h, yes in zip(H, on_gpu, strict=True) if yes])
        ix.add_many(node, [offloaded(h) for h, yes in zip(H, copied, strict=True) if yes])
        g = next((i for i, yes in enumerate(on_gpu) if not yes), len(H))
        c = next((i for i in range(g, len(H)) if not copied[i]), len(H)) - g
        if g:
            want_gpu[node] = g
        if c:
            want_tier[node] = c
    assert ix.match_tiers(H, offloaded) == (want_gpu, want_tier)
