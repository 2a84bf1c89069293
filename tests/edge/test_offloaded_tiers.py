"""The router values a block a node holds only in an offloaded tier (CPU, disk) at
``router.offload_hit_value`` of a GPU hit, after that node's GPU prefix."""

from __future__ import annotations

from streams.blocks import approx_tokenize, chain_hashes, offloaded
from tests.edgekit import MODEL, edge


async def test_offloaded_copies_count_as_a_cheaper_miss() -> None:
    prompt = "a document everyone asks about, long enough for many blocks. " * 40
    # tenants share one cache here: the hashes are the unsalted ones
    async with edge(engines=3, router={"offload_hit_value": 0.5, "cache_isolation": "off"}) as e:
        hashes = chain_hashes(approx_tokenize(prompt), 16)
        n = len(hashes)
        assert n >= 20
        index = e.router.replica.index
        index.add_many("n1", hashes[:4])  # a short GPU prefix
        index.add_many("n2", [offloaded(h) for h in hashes])  # the whole prompt, on CPU
        index.add_many("n3", [*hashes[:4], *(offloaded(h) for h in hashes[4:])])
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        status, d, _ = await e.call("POST", "/v1/kvgate/decide", body, base=e.admin_url)
        assert status == 200, d
        hit = {c["node_id"]: c["hit_blocks"] for c in d["candidates"]}
        assert hit == {"n1": 4, "n2": n // 2, "n3": 4 + (n - 4) // 2}
        assert d["chosen_node"] == "n3"  # GPU prefix and the rest loaded beats either alone
